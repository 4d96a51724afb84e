"""`agent-rl tiny-model OUT_DIR`: build the offline tiny model from the command line."""

from __future__ import annotations

import argparse
import time

from agent_rl.tiny_model import TinyModelSpec, build_tiny_model


def main(argv: list[str] | None = None) -> int:
    defaults = TinyModelSpec()
    parser = argparse.ArgumentParser(prog="agent-rl tiny-model", description=__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--hidden-size", type=int, default=defaults.hidden_size)
    parser.add_argument("--layers", type=int, default=defaults.num_layers)
    parser.add_argument("--heads", type=int, default=defaults.num_heads)
    parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    args = parser.parse_args(argv)
    if args.hidden_size % args.heads:
        parser.error(f"--hidden-size {args.hidden_size} must be divisible by --heads {args.heads}")
    spec = TinyModelSpec(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_layers=args.layers,
        num_heads=args.heads,
        intermediate_size=2 * args.hidden_size,
        seed=args.seed,
    )
    start = time.perf_counter()
    out = build_tiny_model(args.out_dir, spec)
    print(f"tiny model written to {out} in {time.perf_counter() - start:.1f}s")
    return 0
