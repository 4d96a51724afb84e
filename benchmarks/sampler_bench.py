"""Benchmark: the HF engine's per-step sampling cost against the LM-head matmul, at a real vocabulary.

What it measures (medians over repeats, one torch thread; read the ratios, the machine is shared):
1. head: the decode step's LM-head matmul, (B, hidden) @ (hidden, V), the work sampling follows.
2. sampling before: the engine's first sampler, kept here as the baseline: a nucleus filter that
   sorts the whole vocabulary every step (even at top_p = 1), log_softmax, torch.multinomial per row.
3. sampling after: `sample_tokens` as the engine runs it: softmax once; no selection at top_p = 1;
   below it a top-k of 64 for peaked rows and a two-pass radix select (a histogram over the float
   bits, then only the boundary bin's tokens sorted) for the rest; an inverse-CDF draw per row that
   rejects tokens outside the nucleus instead of masking the row.
Each is printed as milliseconds and as a ratio to the head matmul (target: after <= 20% of the head),
with the same-run speed-up before / after.

Run:  python benchmarks/sampler_bench.py [--vocab 152064 --hidden 896 --batch 1 8 32 --repeats 20]
(152,064 and 896 are Qwen2.5-0.5B's vocabulary and hidden size.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch

from agent_rl.rollout.hf_engine import nucleus, sample_tokens


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up (allocator, kernels)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def logits_like_a_model(batch: int, vocab: int, generator: torch.Generator, zipf: float) -> torch.Tensor:
    """(B, V) logits with a Zipf-like head and tail (p_rank ~ rank^-zipf), as trained LMs give; pure
    Gaussian logits would make every nucleus huge. zipf 1.2 gives nuclei of hundreds to a few
    thousand tokens at top_p 0.9-0.95; 1.05 a flat, open-ended one of tens of thousands."""
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    base = -zipf * ranks.log()
    rows = [base[torch.randperm(vocab, generator=generator)] for _ in range(batch)]
    return torch.stack(rows) + 0.5 * torch.randn((batch, vocab), generator=generator)


def sample_by_sort(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, gens: Sequence[torch.Generator]
) -> list[int]:
    """The engine's first sampler (the baseline): sort the vocabulary, cut the nucleus, multinomial."""
    scaled = logits / temperature[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # (B, V)
    probs = sorted_logits.softmax(dim=-1)
    drop_sorted = probs.cumsum(dim=-1) - probs >= top_p[:, None]
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    log_probs = scaled.masked_fill(drop, float("-inf")).log_softmax(dim=-1)
    return [int(torch.multinomial(row.exp(), 1, generator=g)) for row, g in zip(log_probs, gens, strict=True)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=152_064)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--top-p", type=float, nargs="+", default=[1.0, 0.95, 0.9])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--zipf", type=float, default=1.2, help="tail exponent of the synthetic logits")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    head = torch.randn((args.vocab, args.hidden), generator=generator) / args.hidden**0.5  # (V, H)
    print(
        f"sampler benchmark: vocab {args.vocab}, hidden {args.hidden}, temperature 1, one torch thread, "
        f"medians of {args.repeats}, logits Zipf {args.zipf}"
    )
    header = (
        f"{'batch':>5} {'top_p':>6} {'nucleus':>8} {'head ms':>8} {'before ms':>9} {'before/head':>11} "
        f"{'after ms':>8} {'after/head':>10} {'speed-up':>8}"
    )
    print(header)
    print("-" * len(header))
    for batch in args.batch:
        hidden = torch.randn((batch, args.hidden), generator=generator)
        head_ms = median_ms(lambda h=hidden: h @ head.T, args.repeats)  # (B, V)
        logits = logits_like_a_model(batch, args.vocab, generator, args.zipf)
        temperature = torch.ones(batch)
        active = [True] * batch
        for top_p_value in args.top_p:
            top_p = torch.full((batch,), top_p_value)
            probs = logits.softmax(-1)
            kept = (probs >= nucleus(probs, top_p)[0][:, None]).sum(-1).float().mean()
            gens = [torch.Generator().manual_seed(i) for i in range(batch)]
            before = median_ms(partial(sample_by_sort, logits, temperature, top_p, gens), args.repeats)
            after = median_ms(
                partial(sample_tokens, logits, temperature, top_p, gens, active, 0), args.repeats
            )
            print(
                f"{batch:>5} {top_p_value:>6.2f} {kept:>8.0f} {head_ms:>8.2f} {before:>9.2f} {before / head_ms:>10.0%} "
                f"{after:>8.2f} {after / head_ms:>9.0%} {before / after:>7.1f}x"
            )
    print(
        "before = the first engine's sampler (full-vocabulary sort + multinomial); after = the engine's.\n"
        "nucleus = mean tokens kept per row.\n"
        "x/head = sampling time / the same batch's LM-head matmul time (target after/head <= 20%)."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
