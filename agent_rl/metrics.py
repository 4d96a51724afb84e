"""Metrics every step to JSONL and TensorBoard, and PNG plots at the end.

Fixed prefixes (`env/`, `adv/`, `losses/`, `perf/`, `tokens/`, `grad/`) so dashboards and the
plots below find the same names across runs and estimators.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

PLOTS = {
    "success.png": ("env/success_rate", "success rate"),
    "tokens.png": ("tokens/cumulative", "cumulative rollout tokens"),
    "grad_norm.png": ("grad/norm", "gradient norm"),
    "reward.png": ("env/reward_mean", "mean reward"),
}


TIMING_PREFIX = "perf/"
"""Metrics under this prefix measure the machine (wall times, throughput), not the learning: they
go to `perf.jsonl`, so that `metrics.jsonl` is bit-identical across runs of one config and seed."""


class MetricsLogger:
    """Append-only JSONL (the source of truth) plus TensorBoard when it is installed.

    `metrics.jsonl` holds what the run computed; `perf.jsonl` holds timings, each line tagged with
    the index of the `metrics.jsonl` line it belongs to (`read_metrics` joins them back).
    """

    def __init__(self, run_dir: Path, tensorboard: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.perf_path = self.run_dir / "perf.jsonl"
        self._row = len(_lines(self.path))
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
            except ImportError:
                self._tb = None

    def truncate_after(self, step: int) -> None:
        """On resume, drop lines written after the checkpoint so the log has no duplicate steps."""
        kept = [line for line in _lines(self.path) if json.loads(line).get("step", 0) <= step]
        self.path.write_text("".join(line + "\n" for line in kept))
        timings = [line for line in _lines(self.perf_path) if json.loads(line)["row"] < len(kept)]
        self.perf_path.write_text("".join(line + "\n" for line in timings))
        self._row = len(kept)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        clean = {k: _plain(v) for k, v in metrics.items()}
        learning = {k: v for k, v in clean.items() if not k.startswith(TIMING_PREFIX)}
        timing = {k: v for k, v in clean.items() if k.startswith(TIMING_PREFIX)}
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **learning}) + "\n")
        if timing:
            with self.perf_path.open("a") as f:
                f.write(json.dumps({"step": step, "row": self._row, **timing}) + "\n")
        self._row += 1
        if self._tb is not None:
            for k, v in clean.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def _lines(path: Path) -> list[str]:
    """The file's complete lines. Every record is written with its newline, so a last line without
    one was torn by a crash mid-append: it is dropped (resuming then rewrites the file without it)."""
    if not path.exists():
        return []
    *complete, _torn_or_empty = path.read_text().split("\n")
    return [line for line in complete if line.strip()]


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        return v.item()
    return v


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every logged row, with its timings (from perf.jsonl) merged back in."""
    rows = [json.loads(line) for line in _lines(Path(run_dir) / "metrics.jsonl")]
    for line in _lines(Path(run_dir) / "perf.jsonl"):
        timing = json.loads(line)
        row = timing.pop("row")
        if row < len(rows) and rows[row]["step"] == timing.pop("step"):
            rows[row].update(timing)
    return rows


def write_plots(run_dir: Path) -> list[Path]:
    """PNG plots of the headline curves; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    out = []
    for fname, (key, label) in PLOTS.items():
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if not pts:
            continue
        fig, ax = plt.subplots(figsize=(5, 3.2), dpi=110)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label="training batch")
        if key == "env/success_rate":  # greedy held-out evaluations, before and after RL
            evals = [(r["step"], r["eval/success_rate"]) for r in rows if "eval/success_rate" in r]
            if evals:
                ax.plot(*zip(*evals), "s--", color="C3", label="held-out eval (greedy)")
                ax.legend(fontsize=7)
        ax.set_xlabel("RL step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = Path(run_dir) / "plots" / fname
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
        plt.close(fig)
        out.append(path)
    return out
