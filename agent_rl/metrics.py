"""Metrics every step to JSONL and TensorBoard, and PNG plots at the end.

Fixed prefixes (`env/`, `adv/`, `losses/`, `perf/`, `tokens/`, `grad/`) so dashboards and the
plots below find the same names across runs and estimators.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

TIMING_PREFIX = "perf/"
"""Metrics under this prefix measure the machine (wall times, throughput), not the learning: they
go to `perf.jsonl`, so that `metrics.jsonl` is bit-identical across runs of one config and seed."""


class MetricsLogger:
    """Append-only JSONL (the source of truth) plus TensorBoard when it is installed, plus Weights &
    Biases when asked for.

    `metrics.jsonl` holds what the run computed; `perf.jsonl` holds timings, each line tagged with
    the index of the `metrics.jsonl` line it belongs to (`read_metrics` joins them back).
    """

    def __init__(self, run_dir: Path, tensorboard: bool = True, wandb: WandbSink | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.perf_path = self.run_dir / "perf.jsonl"
        self.warmup_path = self.run_dir / "warmup.jsonl"
        self._row = len(_lines(self.path))
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
            except ImportError:
                self._tb = None
        self._wandb = wandb

    def log_warmup(self, step: int, loss: float) -> None:
        """The warm-up's loss per update: `warmup.jsonl` (its own file, so the RL log keeps one row
        per RL step) and TensorBoard's `warmup/loss`. Step 0 starts the file afresh."""
        with self.warmup_path.open("w" if step == 0 else "a") as f:
            f.write(json.dumps({"step": step, "warmup/loss": loss}) + "\n")
        if self._tb is not None and math.isfinite(loss):
            self._tb.add_scalar("warmup/loss", loss, step)
        if self._wandb is not None:
            self._wandb.log("warmup/step", step, {"warmup/loss": loss})

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
        if self._wandb is not None:
            self._wandb.log("rl/step", step, clean)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.close()


class WandbSink:
    """Weights & Biases as one more place the same rows go (`run.wandb: true`; `pip install wandb`).

    Offline by default (`run.wandb_mode`): nothing leaves the machine until `wandb sync <dir>`.
    Why explicit x-axes: W&B's own step only grows, but a run logs the warm-up's updates and then
    RL steps from 0 again, and a resumed run repeats steps; each metric family is plotted against
    its own logged counter (`warmup/step`, `rl/step`) instead.
    """

    def __init__(self, run_dir: Path, name: str, project: str, mode: str, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ImportError("run.wandb is on but wandb is not installed: pip install wandb") from err
        # One W&B run per run directory: a resume continues it; another directory of the same name
        # (another machine, another out_dir) is another run.
        run_id = f"{name}-{hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:8]}"
        self.run = wandb.init(
            project=project, name=name, id=run_id, dir=str(run_dir), mode=mode, config=config, resume="allow"
        )
        self._families: set[str] = set()

    def log(self, axis: str, step: int, row: dict[str, Any]) -> None:
        numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        for family in {k.split("/", 1)[0] for k in numbers} - self._families:
            if not self._families:
                self.run.define_metric("rl/step")
                self.run.define_metric("warmup/step")
            self._families.add(family)
            self.run.define_metric(f"{family}/*", step_metric=axis)
        self.run.log({**numbers, axis: step})

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() returns before wandb's service process has written the run's last records (an
        # offline run's file then held its header only, 1 time in 3 here); teardown waits for it.
        wandb.teardown()


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


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last `window` points (fewer at the start): the curve a reader follows,
    drawn over the faint raw points so the noise stays visible."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def _curve(ax: Any, x: list[float], y: list[float], label: str, color: str) -> None:
    window = max(1, len(y) // 10)
    ax.plot(x, y, color=color, alpha=0.25, linewidth=1)
    ax.plot(x, smooth(y, window), color=color, linewidth=2, label=f"{label} (mean of {window})")


def _series(rows: list[dict[str, Any]], key: str, x: str = "step") -> tuple[list[float], list[float]]:
    pts = [(r[x], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and x in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def _success_panel(ax: Any, rows: list[dict[str, Any]]) -> bool:
    steps = [r for r in rows if "env/success_rate" in r]
    if not steps:
        return False
    _curve(ax, *_series(steps, "env/success_rate"), "training batch", "C0")
    evals = _series(rows, "eval/success_rate")
    if evals[0]:
        ax.plot(*evals, "s--", color="C3", label="held-out eval (greedy)")
    ax.set(xlabel="RL step", ylabel="success rate", ylim=(-0.03, 1.03), title="success")
    return True


def _tokens_panel(ax: Any, rows: list[dict[str, Any]]) -> bool:
    steps = [r for r in rows if "env/success_rate" in r and "tokens/cumulative" in r]
    if not steps:
        return False
    x = [r["tokens/cumulative"] for r in steps]
    _curve(ax, x, [r["env/success_rate"] for r in steps], "training batch", "C2")
    ax.set(xlabel="rollout tokens (cumulative)", ylabel="success rate", ylim=(-0.03, 1.03))
    ax.set_title("success per token spent")
    return True


def _grad_panel(ax: Any, rows: list[dict[str, Any]]) -> bool:
    x, y = _series(rows, "grad/norm")
    if not x:
        return False
    _curve(ax, x, y, "gradient norm", "C1")
    ax.set(xlabel="RL step", ylabel="gradient norm", title="gradient norm")
    return True


def _warmup_panel(ax: Any, rows: list[dict[str, Any]]) -> bool:
    x, y = _series(rows, "warmup/loss")
    if not x:
        return False
    _curve(ax, x, y, "loss", "C4")
    ax.set(xlabel="warm-up update", ylabel="cross-entropy", yscale="log", title="supervised warm-up")
    return True


PANELS = {
    "warmup_loss.png": _warmup_panel,
    "success.png": _success_panel,
    "success_vs_tokens.png": _tokens_panel,
    "grad_norm.png": _grad_panel,
}
"""One figure each, and all of them side by side in summary.png. Mean reward and cumulative tokens
have no plot of their own: with 0/1 rewards the first repeats success, the second is a straight line."""


def write_plots(run_dir: Path) -> list[Path]:
    """A PNG per panel that has data, plus `summary.png` with every panel: the slide of the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    rows += [json.loads(line) for line in _lines(Path(run_dir) / "warmup.jsonl")]
    folder = Path(run_dir) / "plots"
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name, panel in PANELS.items():
        fig, ax = plt.subplots(figsize=(5, 3.2), dpi=110)
        if panel(ax, rows):
            out.append(_save(fig, [ax], folder / name))
        plt.close(fig)
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.4), dpi=110)
    drawn = [panel(ax, rows) for ax, panel in zip(axes.flat, PANELS.values())]
    if any(drawn):
        for ax, ok in zip(axes.flat, drawn):
            ax.set_visible(ok)
        fig.suptitle(_headline(Path(run_dir), rows))
        out.append(_save(fig, axes.flat, folder / "summary.png"))
    plt.close(fig)
    return out


def _save(fig: Any, axes: Any, path: Path) -> Path:
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _headline(run_dir: Path, rows: list[dict[str, Any]]) -> str:
    evals = [r["eval/success_rate"] for r in rows if "eval/success_rate" in r]
    steps = sum(1 for r in rows if "env/success_rate" in r)
    held_out = f", held-out success {evals[0]:.2f} -> {evals[-1]:.2f}" if len(evals) >= 2 else ""
    return f"{run_dir.name}: {steps} RL steps{held_out}"
