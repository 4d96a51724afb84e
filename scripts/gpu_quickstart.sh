#!/usr/bin/env bash
# A short GPU run of the quickstart recipe with a real instruct model and vLLM; prints its numbers.
# Usage: scripts/gpu_quickstart.sh /path/to/Qwen2.5-0.5B-Instruct [extra --set overrides]
# Needs: one CUDA GPU, `pip install -e '.[vllm]'`, bubblewrap. Aim: under 10 minutes on one H100-class GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:?usage: $0 MODEL_DIR [--set k=v ...]}"
shift
agent-rl doctor
start=$(date +%s)
agent-rl train --config configs/gpu.yaml --set model.path="$model" --set train.steps=10 --set env.eval_tasks=64 "$@"
echo "wall time: $(( $(date +%s) - start ))s"
python - <<'PY'
import json
rows = [json.loads(l) for l in open("runs/gpu/metrics.jsonl")]
train = [r for r in rows if "losses/loss" in r]
evals = [r for r in rows if "eval/success_rate" in r]
print(f"eval success (greedy): {evals[0]['eval/success_rate']:.3f} -> {evals[-1]['eval/success_rate']:.3f}")
print(f"training success: first {train[0]['env/success_rate']:.3f}, last {train[-1]['env/success_rate']:.3f}")
print(f"rollout tokens: {train[-1]['tokens/cumulative']}; median step: rollout "
      f"{sorted(r['perf/rollout_s'] for r in train)[len(train)//2]:.1f}s, update "
      f"{sorted(r['perf/update_s'] for r in train)[len(train)//2]:.1f}s")
PY
