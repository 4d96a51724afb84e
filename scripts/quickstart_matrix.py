"""Does the quickstart learn on this machine? Seeds x CPU kernel paths, one table.

    python scripts/quickstart_matrix.py                 # seeds 0-4 x {default, avx2}: 10 runs
    python scripts/quickstart_matrix.py --seeds 0 --kernels avx2

Each cell is the README's main job (`agent-rl train --config configs/quickstart.yaml`) in its own
process with `train.seed` set, and for the `avx2` cells `ATEN_CPU_CAPABILITY=avx2`, which makes
torch use its AVX2 kernels on a CPU that has AVX-512 or AMX: float results differ between the
kernel paths, and a learning claim must hold on both. Two cells run at a time (the config uses one
torch thread per run). A cell passes the bar when greedy held-out success starts <= 0.5, ends
>= 0.8 and gains >= 0.3, in <= 300 s end to end. Exit status 1 when any cell misses it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BAR = {"start_max": 0.5, "end_min": 0.8, "gain_min": 0.3, "seconds_max": 300.0}


@dataclass
class Cell:
    seed: int
    kernel: str
    start: float = float("nan")
    end: float = float("nan")
    check: float = float("nan")
    """Greedy final-turn accuracy right after the warm-up (copying a tool's output), when checked."""
    seconds: float = float("nan")
    error: str = ""

    @property
    def passed(self) -> bool:
        return (
            not self.error
            and self.start <= BAR["start_max"]
            and self.end >= BAR["end_min"]
            and self.end - self.start >= BAR["gain_min"]
            and self.seconds <= BAR["seconds_max"]
        )


def run_cell(seed: int, kernel: str, out_dir: Path, config: Path, extra: list[str] | None = None) -> Cell:
    """One quickstart run in a fresh process; greedy held-out success before and after RL."""
    env = dict(os.environ)
    env.pop("ATEN_CPU_CAPABILITY", None)
    if kernel != "default":
        env["ATEN_CPU_CAPABILITY"] = kernel
    run_dir = out_dir / f"seed{seed}-{kernel}"
    cmd = [sys.executable, "-m", "agent_rl.cli", "train", "--config", str(config)]
    for override in [f"run.out_dir={run_dir}", "run.progress=false", f"train.seed={seed}", *(extra or [])]:
        cmd += ["--set", override]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    cell = Cell(seed, kernel, seconds=time.perf_counter() - started)
    summaries = list(run_dir.glob("*/summary.json"))
    if done.returncode != 0 or not summaries:
        cell.error = (done.stderr or done.stdout)[-2000:] or f"exit {done.returncode}"
        return cell
    summary = json.loads(summaries[0].read_text())
    cell.start = summary["eval_before"]["eval/success_rate"]
    cell.end = summary["eval_after"]["eval/success_rate"]
    cell.check = summary.get("eval/final_turn_accuracy", float("nan"))
    return cell


def table(cells: list[Cell]) -> str:
    lines = [
        "| seed | kernels | warm-up check | start | end | gain | seconds | bar |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        verdict = "pass" if c.passed else ("error" if c.error else "FAIL")
        lines.append(
            f"| {c.seed} | {c.kernel} | {c.check:.3f} | {c.start:.3f} | {c.end:.3f} | {c.end - c.start:+.3f} "
            f"| {c.seconds:.0f} | {verdict} |"
        )
    ok = [c for c in cells if not c.error]
    if ok:
        lines.append(
            f"| median | | {statistics.median(c.check for c in ok):.3f} "
            f"| {statistics.median(c.start for c in ok):.3f} "
            f"| {statistics.median(c.end for c in ok):.3f} "
            f"| {statistics.median(c.end - c.start for c in ok):+.3f} "
            f"| {statistics.median(c.seconds for c in ok):.0f} | {sum(c.passed for c in cells)}/{len(cells)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--kernels", nargs="+", default=["default", "avx2"])
    p.add_argument("--config", type=Path, default=REPO / "configs" / "quickstart.yaml")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "quickstart_matrix")
    p.add_argument("--parallel", type=int, default=2, help="cells at a time (one torch thread each)")
    p.add_argument("--set", dest="extra", action="append", default=[], help="extra config override")
    args = p.parse_args(argv)
    jobs = [(s, k) for s in args.seeds for k in args.kernels]
    with ThreadPoolExecutor(args.parallel) as pool:
        cells = list(pool.map(lambda j: run_cell(j[0], j[1], args.out, args.config, args.extra), jobs))
    import torch

    print(
        f"quickstart matrix: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"default kernels {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, "
        f"{args.parallel} cells at a time, load {os.getloadavg()[0]:.1f}"
    )
    print(table(cells))
    for c in cells:
        if c.error:
            print(f"\nseed {c.seed} {c.kernel} failed:\n{c.error}")
    return 0 if all(c.passed for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
