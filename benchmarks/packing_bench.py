"""Benchmark: the learner's training pass on a micro-batch of mixed lengths, padded vs packed.

What it measures (CPU): one forward + backward of a Qwen2-shaped model through the learner's
chunked log-prob and entropy head, on one micro-batch of one long row and several short ones
(default one of 8,192 tokens and seven of 500, each a 64-token prompt and the rest response),
laid out as `agent_rl.batch.collate` lays them out. "padded" is the learner's default path
(`causal_lm_token_stats`: every row padded to the longest); "packed" is `algo.pack_tokens`
(`agent_rl.packing.packed_token_stats`: rows end to end, one forward per packed row).

Columns: padding fraction and tokens processed by the backbone; CPU seconds of the pass (one
thread, median of --repeats; CPU time rather than wall time, so other load on a shared machine
inflates it less); peak memory as the rise of the resident-set high-water mark (VmHWM, reset via
/proc/self/clear_refs once the model and inputs exist) in a fresh subprocess per layout, so one
layout's peak cannot hide the other's. The ratio column is packed / padded, measured in the same
run. Linux only (reads /proc).

Run:  python benchmarks/packing_bench.py [--long 8192 --short 500 --n-short 7 --pack-tokens 16384]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

PROMPT = 64
"""Prompt tokens of every row (the rest of its length is response)."""


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _batch(lengths: list[int], vocab: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(input_ids, attention_mask, R): prompts left-padded to PROMPT, responses right-padded."""
    g = torch.Generator().manual_seed(0)
    r = max(lengths) - PROMPT
    ids = torch.zeros(len(lengths), PROMPT + r, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(1, vocab, (n,), generator=g)
        mask[i, :n] = 1
    return ids, mask, r


def _model(hidden: int, layers: int, vocab: int, max_len: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=max(4096, max_len + 1),
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()


def _child(
    layout: str, lengths: list[int], hidden: int, layers: int, vocab: int, budget: int, repeats: int
) -> None:
    from agent_rl.logprobs import causal_lm_token_stats
    from agent_rl.packing import packed_token_stats

    torch.set_num_threads(1)
    model = _model(hidden, layers, vocab, max(lengths))
    ids, mask, r = _batch(lengths, vocab)
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)

    def run() -> None:
        if layout == "packed":
            stats = packed_token_stats(
                model,
                ids,
                mask,
                response_length=r,
                budget=budget,
                position_ids=position_ids,
                with_sum_pi_squared=False,
            )
        else:
            stats = causal_lm_token_stats(
                model, ids, mask, response_length=r, position_ids=position_ids, with_sum_pi_squared=False
            )
        (stats.log_probs.sum() + 0.01 * stats.entropy.sum()).backward()
        model.zero_grad(set_to_none=True)

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _rss_kib("VmRSS")
    seconds = []
    for _ in range(repeats):
        cpu = time.process_time()
        run()
        seconds.append(time.process_time() - cpu)
    print(json.dumps({"extra_mib": (_rss_kib("VmHWM") - before) / 1024, "cpu_s": statistics.median(seconds)}))


def _processed(layout: str, lengths: list[int], budget: int) -> int:
    if layout == "padded":
        return len(lengths) * max(lengths)
    from agent_rl.packing import first_fit_decreasing

    return sum(sum(lengths[i] for i in b) for b in first_fit_decreasing(lengths, budget))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--long", type=int, default=8192, help="tokens of the long row(s)")
    parser.add_argument("--n-long", type=int, default=1)
    parser.add_argument("--short", type=int, default=500, help="tokens of each short row")
    parser.add_argument("--n-short", type=int, default=7)
    parser.add_argument("--pack-tokens", type=int, default=16384, help="algo.pack_tokens")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    lengths = [args.long] * args.n_long + [args.short] * args.n_short
    if min(lengths) <= PROMPT:
        parser.error(f"every row needs more than the {PROMPT} prompt tokens")
    if args.child:
        _child(args.child, lengths, args.hidden, args.layers, args.vocab, args.pack_tokens, args.repeats)
        return
    real = sum(lengths)
    print(
        f"packing_bench: torch {torch.__version__}, 1 thread, Qwen2 {args.layers}L h{args.hidden} V{args.vocab}, "
        f"rows {args.n_long}x{args.long} + {args.n_short}x{args.short} ({real} real tokens), "
        f"pack_tokens {args.pack_tokens}; one forward + backward, CPU s median of {args.repeats}, "
        "fresh process per layout"
    )
    rows = {}
    for layout in ("padded", "packed"):
        cmd = [sys.executable, __file__, "--child", layout] + [
            a for a in (argv or sys.argv[1:]) if a != "--child"
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows[layout] = json.loads(out.stdout.strip().splitlines()[-1])
        rows[layout]["tokens"] = _processed(layout, lengths, args.pack_tokens)
    print(f"{'layout':>8}{'pad frac':>10}{'tokens':>9}{'cpu s':>9}{'peak MiB':>10}")
    for layout, r in rows.items():
        print(
            f"{layout:>8}{1 - real / r['tokens']:>10.3f}{r['tokens']:>9}{r['cpu_s']:>9.2f}{r['extra_mib']:>10.0f}"
        )
    pad, pk = rows["padded"], rows["packed"]
    print(
        f"{'ratio':>8}{'':>10}{pk['tokens'] / pad['tokens']:>9.3f}{pk['cpu_s'] / pad['cpu_s']:>9.3f}"
        f"{pk['extra_mib'] / pad['extra_mib']:>10.3f}   (packed / padded)"
    )


if __name__ == "__main__":
    main()
