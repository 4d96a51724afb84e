"""Benchmark: the OTB proxy (sum p^2) and entropy in the log-prob pass, chunked, against plain and naive.

What it measures (CPU; the machine is shared, so medians of repeated runs are reported):
1. Equality: max |difference| of log-probs, entropy and sum p^2 of the chunked path against a naive
   full-softmax computation in float32 and against a float64 reference. Target <= 1e-5.
2. Time overhead over the plain log-prob forward. "plain" = the same backbone forward + chunked
   log-probs only (logsumexp + gather), i.e. what the trainer runs without OTB. "+stats" adds entropy
   and sum p^2 in the same pass. Measured for the no-grad old-log-prob pass (where OTB's proxy is
   computed) and for forward + backward of the training pass. Target: overhead <= 5%.
   The head alone (no backbone) is reported too, since it bounds the overhead from above.
3. Peak memory of the head computation against the naive full-logits softmax. Measured as the rise
   of the resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs after the inputs
   are allocated) in a *fresh subprocess per method*, so each method's extra peak is isolated and
   import-time peaks do not hide it. Large tensors are mmap'ed by glibc and unmapped on free, so RSS
   tracks tensor memory at KiB resolution. Outputs (N floats) and, with backward, the weight
   gradient (V x H) are part of every method's extra. Target: chunked extra ~ one chunk's logits
   (chunk_size x V x 4 bytes) or so, far below the naive (N x V) tensors.
   Linux only (reads /proc).

Run:  python benchmarks/proxy_bench.py [--tokens 2048 --vocab 151936 --hidden 256 --chunk-size 1024]
Targets (issue #18) at V = 152k: all stats <= 5% over the plain log-prob pass, same run; extra peak
memory <= 1 chunk of logits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from agent_rl.logprobs import token_stats_from_hidden


@dataclass(frozen=True)
class BenchConfig:
    tokens: int = 1024
    """N = batch x length response tokens scored per pass (timing and equality)."""
    batch: int = 2
    """Sequences per pass (tokens are split evenly over them for the backbone)."""
    hidden: int = 512
    vocab: int = 151936
    """Qwen2/Qwen2.5's vocabulary: the LM head's cost is what the statistics add to, so a small
    vocabulary (32k was the default) hides it."""
    layers: int = 8
    """Default proportions follow Qwen2.5-0.5B, scaled to a CPU (at V = 152k the head is about as
    costly as the 8-layer backbone here)."""
    chunk_size: int = 1024
    repeats: int = 7
    """Timed repetitions per method (after one warm-up, interleaved round-robin); medians are reported."""
    threads: int = 1
    """torch threads. 1 by default: on a shared, loaded machine extra threads only add noise."""
    mem_tokens: int = 3072
    """N for the memory section (bigger, so the full (N x V) logits are several chunks: 3 at the
    default chunk and vocabulary, 1.7 GiB each, so the naive path's backward peaks near 10 GiB)."""
    mem_hidden: int = 64
    """Hidden size for the memory section (memory barely depends on it; keeps the matmuls cheap)."""
    seed: int = 0


# ---------------------------------------------------------------- the computations compared


def naive_stats(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
    """Full (N, V) logits, log_softmax, softmax: what `model(...).logits` + a softmax costs."""
    logits = (hidden @ weight.T).float()  # (N, V)
    log_p = torch.log_softmax(logits, dim=-1)  # (N, V)
    p = log_p.exp()  # (N, V)
    return log_p.gather(-1, targets[:, None]).squeeze(-1), -(p * log_p).sum(-1), p.square().sum(-1)


def plain_log_probs(hidden, weight, targets, chunk_size):
    return token_stats_from_hidden(
        hidden, weight, targets, chunk_size=chunk_size, with_entropy=False, with_sum_pi_squared=False
    ).log_probs


def torch_logsumexp(hidden, weight, targets, chunk_size):
    """The textbook plain pass, torch's own kernels per chunk: a reference for how fast "plain" is."""
    out = []
    for start in range(0, hidden.shape[0], chunk_size):
        z = (hidden[start : start + chunk_size] @ weight.T).float()  # (C, V)
        out.append(z.gather(1, targets[start : start + chunk_size, None]).squeeze(1) - torch.logsumexp(z, -1))
    return torch.cat(out)


def entropy_only(hidden, weight, targets, chunk_size):
    s = token_stats_from_hidden(hidden, weight, targets, chunk_size=chunk_size, with_sum_pi_squared=False)
    return s.log_probs, s.entropy


def all_stats(hidden, weight, targets, chunk_size):
    s = token_stats_from_hidden(hidden, weight, targets, chunk_size=chunk_size)
    return s.log_probs, s.entropy, s.sum_pi_squared


def make_model(cfg: BenchConfig):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=cfg.vocab,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.hidden * 4,
        num_hidden_layers=cfg.layers,
        num_attention_heads=max(1, cfg.hidden // 64),
        num_key_value_heads=max(1, cfg.hidden // 64),
        max_position_embeddings=max(4096, cfg.tokens),
        tie_word_embeddings=True,
    )
    torch.manual_seed(cfg.seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def make_head_inputs(cfg: BenchConfig):
    gen = torch.Generator().manual_seed(cfg.seed)
    hidden = torch.randn(cfg.tokens, cfg.hidden, generator=gen)
    weight = torch.randn(cfg.vocab, cfg.hidden, generator=gen) / cfg.hidden**0.5 * 3.0  # logits std ~3
    targets = torch.randint(0, cfg.vocab, (cfg.tokens,), generator=gen)
    return hidden, weight, targets


# ---------------------------------------------------------------- timing


def interleaved(
    fns: dict[str, Callable[[], object]], repeats: int
) -> dict[str, tuple[list[float], list[float]]]:
    """Round-robin the methods so drifting machine load hits them all alike. -> name: (cpu s, wall s).

    CPU time of this process (time.process_time) is the primary measure: on a shared machine wall
    time mostly measures the neighbours; with one torch thread CPU time is the work done.
    """
    for fn in fns.values():
        fn()
    times: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            cpu, wall = time.process_time(), time.perf_counter()
            fn()
            times[name][0].append(time.process_time() - cpu)
            times[name][1].append(time.perf_counter() - wall)
    return times


def p90(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, round(0.9 * (len(xs) - 1)))]


def print_time_table(title: str, times: dict[str, tuple[list[float], list[float]]], baseline: str) -> None:
    base = statistics.median(times[baseline][0])
    print(f"\n{title}")
    print(f"{'method':<34}{'cpu med ms':>11}{'cpu p90':>9}{'ratio':>8}{'wall med ms':>13}{'wall p90':>10}")
    for name, (cpu, wall) in times.items():
        med = statistics.median(cpu)
        print(
            f"{name:<34}{med * 1e3:>11.1f}{p90(cpu) * 1e3:>9.1f}{med / base:>8.3f}"
            f"{statistics.median(wall) * 1e3:>13.1f}{p90(wall) * 1e3:>10.1f}"
        )


def time_backbone(cfg: BenchConfig) -> None:
    model = make_model(cfg)
    seq = cfg.tokens // cfg.batch
    ids = torch.randint(0, cfg.vocab, (cfg.batch, seq + 1), generator=torch.Generator().manual_seed(cfg.seed))
    head = model.get_output_embeddings().weight
    backbone = model.get_decoder()

    def run(stats_fn, grad: bool, entropy_bonus: bool = False):
        """entropy_bonus: backpropagate the entropy too (entropy_coef > 0); otherwise it is a metric."""

        def go():
            with torch.set_grad_enabled(grad):
                hidden = backbone(input_ids=ids[:, :-1], use_cache=False).last_hidden_state  # (B, T, H)
                out = stats_fn(hidden.reshape(-1, cfg.hidden), head, ids[:, 1:].reshape(-1), cfg.chunk_size)
                if grad:
                    first = out[0] if isinstance(out, tuple) else out
                    loss = first.sum() + (out[1].sum() * 0.01 if entropy_bonus else 0.0)
                    loss.backward()
                    model.zero_grad(set_to_none=True)

        return go

    def naive_go(grad: bool):
        def go():
            with torch.set_grad_enabled(grad):
                logits = model(input_ids=ids[:, :-1], use_cache=False).logits.reshape(-1, cfg.vocab)  # (N, V)
                log_p = torch.log_softmax(logits.float(), -1)
                p = log_p.exp()
                lp = log_p.gather(-1, ids[:, 1:].reshape(-1, 1))
                ent = -(p * log_p).sum(-1)
                _ = p.square().sum(-1)
                if grad:
                    (lp.sum() + ent.sum() * 0.01).backward()
                    model.zero_grad(set_to_none=True)

        return go

    no_grad = {
        "plain: backbone + log-probs": run(plain_log_probs, False),
        "backbone + log-probs + entropy": run(entropy_only, False),
        "backbone + all stats (+sum p^2)": run(all_stats, False),
        "naive: model logits + softmax": naive_go(False),
    }
    # The learner's update takes log-probs and entropy (sum p^2 comes from the no-grad pass); the
    # entropy is a logged metric unless algo.entropy_coef > 0, and only then is it backpropagated.
    training = {
        "plain: backbone + log-probs": run(plain_log_probs, True),
        "+ entropy as a metric (coef 0)": run(entropy_only, True),
        "+ entropy bonus (coef > 0)": run(entropy_only, True, entropy_bonus=True),
        "naive: model logits + softmax": naive_go(True),
    }
    for fns, label in ((no_grad, "no-grad old-log-prob pass"), (training, "training pass: forward + backward")):
        print_time_table(
            f"Time, {label} (Qwen2 {cfg.layers}L h{cfg.hidden} V{cfg.vocab}, N={cfg.tokens})",
            interleaved(fns, cfg.repeats),
            "plain: backbone + log-probs",
        )


def time_head(cfg: BenchConfig) -> None:
    hidden, weight, targets = make_head_inputs(cfg)
    with torch.no_grad():
        times = interleaved(
            {
                "plain: chunked log-probs": lambda: plain_log_probs(hidden, weight, targets, cfg.chunk_size),
                "torch logsumexp + gather, chunked": lambda: torch_logsumexp(hidden, weight, targets, cfg.chunk_size),
                "chunked log-probs + entropy": lambda: entropy_only(hidden, weight, targets, cfg.chunk_size),
                "chunked all stats (+sum p^2)": lambda: all_stats(hidden, weight, targets, cfg.chunk_size),
                "naive full logits, all stats": lambda: naive_stats(hidden, weight, targets),
            },
            cfg.repeats,
        )
    print_time_table(
        f"Time, LM head only, no grad (N={cfg.tokens}, V={cfg.vocab}, chunk={cfg.chunk_size})",
        times,
        "plain: chunked log-probs",
    )


# ---------------------------------------------------------------- equality


def check_equality(cfg: BenchConfig) -> float:
    """Max |diff| of the chunked statistics against the naive fp32 softmax and an exact reference.

    "exact" is a float64 softmax of the *same* fp32 logits, so it isolates the arithmetic of each
    path from the fp32 rounding of the logits matmul (which both paths share).
    """
    hidden, weight, targets = make_head_inputs(cfg)
    with torch.no_grad():
        got = all_stats(hidden, weight, targets, cfg.chunk_size)
        naive32 = naive_stats(hidden, weight, targets)
        logits = hidden @ weight.T  # (N, V) the fp32 logits both paths see
        log_p = torch.log_softmax(logits.double(), dim=-1)
        p = log_p.exp()
        exact = (log_p.gather(-1, targets[:, None]).squeeze(-1), -(p * log_p).sum(-1), p.square().sum(-1))
        del logits, log_p, p
    print(f"\nEquality (N={cfg.tokens}, V={cfg.vocab}, chunk={cfg.chunk_size}; target max |diff| <= 1e-5)")
    print(f"{'statistic':<16}{'chunked vs naive':>18}{'chunked vs exact':>18}{'naive vs exact':>16}")
    worst = {"chunked vs naive": 0.0, "chunked vs exact": 0.0, "naive vs exact": 0.0}
    for name, g, n, r in zip(("log_probs", "entropy", "sum_pi_squared"), got, naive32, exact, strict=True):
        diffs = (
            float((g - n).abs().max()),
            float((g.double() - r).abs().max()),
            float((n.double() - r).abs().max()),
        )
        for key, d in zip(worst, diffs, strict=True):
            worst[key] = max(worst[key], d)
        print(f"{name:<16}{diffs[0]:>18.2e}{diffs[1]:>18.2e}{diffs[2]:>16.2e}")
    print(
        f"target <= 1e-5: chunked vs exact {'met' if worst['chunked vs exact'] <= 1e-5 else 'MISSED'} "
        f"({worst['chunked vs exact']:.1e}); chunked vs naive fp32 {worst['chunked vs naive']:.1e}, "
        f"the size of the naive path's own fp32 error ({worst['naive vs exact']:.1e})"
    )
    return worst["chunked vs exact"]


# ---------------------------------------------------------------- memory (fresh subprocess per method)


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _peak_rss_child(method: str, cfg_json: str) -> None:
    cfg = BenchConfig(**json.loads(cfg_json))
    torch.set_num_threads(max(1, cfg.threads))
    mem_cfg = BenchConfig(**{**asdict(cfg), "tokens": cfg.mem_tokens, "hidden": cfg.mem_hidden})
    hidden, weight, targets = make_head_inputs(mem_cfg)
    grad = method.endswith("+backward")
    if grad:
        hidden.requires_grad_()
    naive_stats(hidden[:2], weight, targets[:2])  # load kernels once, tiny
    # Reset the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0), so the peak
    # after the method minus the RSS now is this method's extra peak, nothing from imports.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _rss_kib("VmRSS")
    with torch.set_grad_enabled(grad):
        if method.startswith("naive"):
            lp, ent, _ = naive_stats(hidden, weight, targets)
        elif method.startswith("plain"):
            lp, ent = plain_log_probs(hidden, weight, targets, cfg.chunk_size), None
        else:
            lp, ent, _ = all_stats(hidden, weight, targets, cfg.chunk_size)
        if grad:
            loss = lp.sum() + (ent.sum() * 0.01 if ent is not None else 0.0)
            loss.backward()
    print(json.dumps({"extra_mib": (_rss_kib("VmHWM") - before) / 1024}))


def measure_memory(cfg: BenchConfig) -> None:
    chunk_mib = cfg.chunk_size * cfg.vocab * 4 / 2**20
    full_mib = cfg.mem_tokens * cfg.vocab * 4 / 2**20
    print(
        f"\nPeak memory of the head: rise of peak RSS (VmHWM reset via /proc/self/clear_refs) in a fresh "
        f"process per method\nN={cfg.mem_tokens}, H={cfg.mem_hidden}, V={cfg.vocab}, chunk={cfg.chunk_size}: "
        f"one chunk of fp32 logits = {chunk_mib:.0f} MiB; full (N x V) fp32 logits = {full_mib:.0f} MiB; "
        f"weight = {cfg.vocab * cfg.mem_hidden * 4 / 2**20:.0f} MiB"
    )
    print(f"{'method':<34}{'extra peak MiB':>16}{'in chunks':>11}{'vs naive':>10}")
    results = {}
    methods = [
        "naive full logits, no grad",
        "plain chunked log-probs, no grad",
        "chunked all stats, no grad",
        "naive full logits +backward",
        "chunked all stats +backward",
    ]
    for method in methods:
        out = subprocess.run(
            [sys.executable, __file__, "--child", method, "--child-config", json.dumps(asdict(cfg))],
            capture_output=True,
            text=True,
            check=True,
        )
        results[method] = json.loads(out.stdout.strip().splitlines()[-1])["extra_mib"]
    for method in methods:
        naive = results[
            "naive full logits +backward" if method.endswith("+backward") else "naive full logits, no grad"
        ]
        extra = results[method]
        print(f"{method:<34}{extra:>16.0f}{extra / chunk_mib:>11.2f}{extra / naive:>10.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for field, default in asdict(BenchConfig()).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(default), default=default)
    parser.add_argument(
        "--sections", default="equality,head,backbone,memory", help="comma-separated subset of the default"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-config", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _peak_rss_child(args.child, args.child_config)
        return
    cfg = BenchConfig(**{k: getattr(args, k) for k in asdict(BenchConfig())})
    torch.set_num_threads(max(1, cfg.threads))
    print(f"proxy_bench: torch {torch.__version__}, {torch.get_num_threads()} threads, config {asdict(cfg)}")
    sections = set(args.sections.split(","))
    if "equality" in sections:
        check_equality(cfg)
    if "head" in sections:
        time_head(cfg)
    if "backbone" in sections:
        time_backbone(cfg)
    if "memory" in sections:
        measure_memory(cfg)


if __name__ == "__main__":
    main()
