"""Benchmark: peak memory per token of the learner's training pass, with and without activation checkpointing.

What it measures (CPU): one forward + backward of a Qwen2-shaped model through the learner's
chunked log-prob and entropy head (`agent_rl.logprobs.causal_lm_token_stats`, what
`Learner._accumulate` runs) on one row of T tokens. Peak memory is the rise of the resident-set
high-water mark (VmHWM, reset via /proc/self/clear_refs after the model and inputs exist) in a
fresh subprocess per cell, so cells cannot hide each other's peaks; divided by T it is the memory
per token. CPU seconds of the pass (one thread) show what checkpointing costs: about one more
forward of the backbone. Linux only (reads /proc).

Run:  python benchmarks/learner_memory_bench.py [--tokens 1024,4096 --hidden 256 --layers 8]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _child(tokens: int, hidden: int, layers: int, vocab: int, checkpointing: bool) -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from agent_rl.learner import enable_activation_checkpointing
    from agent_rl.logprobs import causal_lm_token_stats

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=max(4096, tokens + 1),
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if checkpointing:
        enable_activation_checkpointing(model)
    model.train()
    ids = torch.randint(0, vocab, (1, tokens + 1), generator=torch.Generator().manual_seed(0))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _rss_kib("VmRSS")
    cpu = time.process_time()
    stats = causal_lm_token_stats(model, ids, response_length=tokens, with_sum_pi_squared=False)
    (stats.log_probs.sum() + 0.01 * stats.entropy.sum()).backward()
    seconds = time.process_time() - cpu
    print(json.dumps({"extra_mib": (_rss_kib("VmHWM") - before) / 1024, "cpu_s": seconds}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="1024,4096", help="comma-separated row lengths T")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        t, h, n, v, c = args.child
        _child(int(t), int(h), int(n), int(v), c == "1")
        return
    print(
        f"learner_memory_bench: torch {torch.__version__}, 1 thread, Qwen2 {args.layers}L h{args.hidden} "
        f"V{args.vocab}; peak RSS rise of one forward + backward, fresh process per cell"
    )
    print(
        f"{'T':>6}{'checkpointing':>15}{'extra MiB':>11}{'KiB/token':>11}{'vs off':>8}{'cpu s':>8}{'vs off':>8}"
    )
    for tokens in (int(t) for t in args.tokens.split(",")):
        rows = {}
        for checkpointing in (False, True):
            cmd = [sys.executable, __file__, "--child", str(tokens), str(args.hidden), str(args.layers)]
            cmd += [str(args.vocab), "1" if checkpointing else "0"]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            rows[checkpointing] = json.loads(out.stdout.strip().splitlines()[-1])
        for checkpointing, r in rows.items():
            base = rows[False]
            print(
                f"{tokens:>6}{'on' if checkpointing else 'off':>15}{r['extra_mib']:>11.0f}"
                f"{r['extra_mib'] * 1024 / tokens:>11.1f}{r['extra_mib'] / base['extra_mib']:>8.2f}"
                f"{r['cpu_s']:>8.2f}{r['cpu_s'] / base['cpu_s']:>8.2f}"
            )


if __name__ == "__main__":
    main()
