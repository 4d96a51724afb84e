"""`agent-rl experiment FILE`: estimators x group sizes x seeds on one task and one token budget.

The paper's claim to test: OTB with N=4 samples per prompt reaches the success of a group baseline
with N=32 using far fewer rollout tokens. Every cell starts from the same warmed-up policy (one
supervised warm-up, shared), sees the same task stream, and stops at the same rollout-token budget.
The report lists, per cell (mean ± std over seeds): rollout tokens to reach the target success,
final success, exact per-sample gradient variance, proxy-vs-true gradient-norm rank correlation,
and gradient-norm spikes; plus success-vs-tokens plots.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agent_rl.config import Config, ConfigError, apply_overrides, build_config
from agent_rl.metrics import read_metrics


class Cell(BaseModel):
    model_config = ConfigDict(extra="forbid")
    estimator: str
    group_size: int = Field(ge=1)

    @property
    def name(self) -> str:
        return f"{self.estimator}-N{self.group_size}"


class ExperimentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = "otb_vs_grpo"
    base: dict[str, Any] = Field(default_factory=dict)
    """A train config (same keys as configs/quickstart.yaml) shared by every cell."""
    cells: list[Cell]
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2])
    max_rollout_tokens: int = Field(gt=0)
    """The shared budget: every run stops after consuming this many rollout tokens."""
    max_steps: int = Field(1000, ge=1)
    target_success: float = Field(0.5, gt=0, le=1)
    """'Tokens to target' = cumulative tokens when the moving success first reaches this."""
    success_window: float = Field(0.1, gt=0, le=1)
    """The moving success averages the steps of the last `success_window` x budget tokens, so that
    cells with small and large steps (N=4 vs N=32) are smoothed over the same amount of data."""
    eval_tasks: int = Field(128, ge=0)
    """Held-out tasks for a greedy evaluation of each run's final policy (and of the start)."""
    grad_variance_every: int = Field(1, ge=0)
    spike_factor: float = Field(3.0, gt=1)
    """A gradient-norm spike is a step whose norm exceeds this multiple of the run's median."""
    out_dir: str = "reports"


def load_experiment(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
    """The experiment file with `--set` overrides (the train config's own parser: `base.train.lr=...`)."""
    data = apply_overrides(yaml.safe_load(Path(path).read_text()) or {}, overrides)
    try:
        exp = ExperimentConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"invalid experiment config {str(path)!r}:\n{err}") from None
    build_config(exp.base)  # validate the shared train config early, with its own clear errors
    return exp


def _cell_config(exp: ExperimentConfig, cell: Cell, seed: int, warm_model: Path, out: Path) -> Config:
    return build_config(
        exp.base,
        [
            f"model.path={warm_model}",
            "train.warmup.steps=0",
            f"algo.estimator={cell.estimator}",
            f"rollout.group_size={cell.group_size}",
            f"train.seed={seed}",
            f"train.steps={exp.max_steps}",
            f"train.max_rollout_tokens={exp.max_rollout_tokens}",
            f"train.grad_variance_every={exp.grad_variance_every}",
            f"run.out_dir={out / 'runs'}",
            f"run.name={cell.name}-s{seed}",
            "run.resume=false",
            "run.progress=false",
        ],
    )


def _finished(cfg: Config) -> bool:
    """A run is reused when it wrote its summary under exactly this config, so that a grid
    stopped halfway (or extended with seeds or cells) only runs what is missing."""
    summary, saved = cfg.run_dir / "summary.json", cfg.run_dir / "config.yaml"
    if not (summary.exists() and saved.exists()):
        return False
    try:  # through today's schema, so settings added since (with defaults) do not count as changes
        return build_config(yaml.safe_load(saved.read_text())) == cfg
    except ConfigError:
        return False


def heldout_success(cfg: Config, tasks: int, *, final: bool = True) -> float:
    """Greedy success on `tasks` held-out tasks of the run's last checkpoint (or, with final=False,
    of cfg's model as it loads), cached in the run folder so that reruns of the grid reuse it."""
    from agent_rl.checkpoint import latest_checkpoint
    from agent_rl.evaluate import evaluate_policy

    cache = cfg.run_dir / ("final_eval.json" if final else "start_eval.json")
    saved = json.loads(cache.read_text()) if cache.exists() else {}
    if saved.get("tasks") == tasks:
        return float(saved["success_rate"])
    if tasks == 0:
        return math.nan
    ckpt = latest_checkpoint(cfg.run_dir) if final else None
    if final and ckpt is None:
        raise FileNotFoundError(f"{cfg.run_dir} has no checkpoint to evaluate")
    success = evaluate_policy(cfg, tasks, ckpt)["eval/success_rate"]
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"tasks": tasks, "success_rate": success}))
    return success


def warm_up_once(exp: ExperimentConfig, out: Path) -> Path:
    """The shared starting policy: the base config's supervised warm-up, saved as a model folder.

    Built from agent_rl.build like the trainer's parts, without a Trainer (no optimiser, engine,
    reference model or logger)."""
    from agent_rl import build
    from agent_rl.warmup import warm_up

    target = out / "warm_model"
    if (target / "config.json").exists():
        return target
    cfg = build_config(exp.base, [f"run.out_dir={out}", "run.name=warmup", "run.progress=false"])
    tasks = build.task_splits(cfg)
    build.check_splits(cfg, tasks, warmup=True)
    build.set_cpu_threads(cfg.model.cpu_threads)
    build.seed_everything(cfg.train.seed)
    path = build.resolve_model_path(cfg)
    model, tokenizer = build.load_model_and_tokenizer(path, cfg.model.dtype, cfg.model.device)
    w = cfg.train.warmup
    if w.steps:
        sandbox = build.make_sandbox(cfg.sandbox)
        try:
            make_env = build.env_factory(cfg, sandbox)
            warm_up(model, tokenizer, make_env, tasks.indices("demo", w.demos), w, cfg.train.seed)
        finally:
            sandbox.close()
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def moving_success(steps: list[dict[str, Any]], window_tokens: float) -> list[float]:
    """Per step, the mean step success over the last `window_tokens` rollout tokens (>= 1 step)."""
    success = [r["env/success_rate"] for r in steps]
    tokens = [r["tokens/cumulative"] for r in steps]
    return [
        statistics.fmean(
            [s for s, t in zip(success[: i + 1], tokens[: i + 1]) if t > tokens[i] - window_tokens]
        )
        for i in range(len(steps))
    ]


def summarize_run(
    rows: list[dict[str, Any]], target: float, spike_factor: float, window_tokens: float
) -> dict[str, float]:
    steps = [r for r in rows if "losses/loss" in r]
    tokens = [r["tokens/cumulative"] for r in steps]
    moving = moving_success(steps, window_tokens)
    tokens_to_target = next((float(t) for t, m in zip(tokens, moving) if m >= target), math.nan)
    norms = [r["grad/norm"] for r in steps if "grad/norm" in r]
    median = statistics.median(norms) if norms else 0.0
    variances = [r["grad/exact_pg_variance"] for r in steps if "grad/exact_pg_variance" in r]
    spearman = [
        r["grad/proxy_spearman"] for r in steps if math.isfinite(r.get("grad/proxy_spearman", math.nan))
    ]
    return {
        "tokens_to_target": tokens_to_target,
        "final_success": moving[-1] if steps else math.nan,
        "tokens_used": float(tokens[-1]) if tokens else 0.0,
        "steps": float(len(steps)),
        "grad_variance": statistics.fmean(variances) if variances else float("nan"),
        "proxy_spearman": statistics.fmean(spearman) if spearman else float("nan"),
        "grad_spikes": float(sum(n > spike_factor * median for n in norms)) if median > 0 else 0.0,
        # time in rollout + update (gradient diagnostics included); start-up and logging not counted
        "minutes": sum(r.get("perf/rollout_s", 0.0) + r.get("perf/update_s", 0.0) for r in steps) / 60,
    }


def _mean_std(values: list[float]) -> str:
    finite = [v for v in values if v == v]
    if not finite:
        return "n/a"
    missing = f" ({len(values) - len(finite)} n/a)" if len(finite) < len(values) else ""
    if len(finite) == 1:
        return f"{finite[0]:.4g}{missing}"
    return f"{statistics.fmean(finite):.4g} ± {statistics.stdev(finite):.2g}{missing}"


COLUMNS = (
    "heldout_success",
    "tokens_to_target",
    "final_success",
    "tokens_used",
    "grad_variance",
    "proxy_spearman",
    "grad_spikes",
    "steps",
    "minutes",
)


def write_report(
    exp: ExperimentConfig, out: Path, results: dict[str, list[dict[str, float]]], start_success: float
) -> Path:
    lines = [
        f"# {exp.name}",
        "",
        f"Budget {exp.max_rollout_tokens} rollout tokens per run; target success {exp.target_success}; "
        f"seeds {exp.seeds}. Mean ± std over seeds. Training success is averaged over the last "
        f"{exp.success_window * exp.max_rollout_tokens:.0f} tokens; heldout_success is the final "
        f"policy's greedy success on {exp.eval_tasks} held-out tasks (the warmed-up start: "
        f"{start_success:.3f}).",
        "",
        "| cell | " + " | ".join(COLUMNS) + " |",
        "|---" * (len(COLUMNS) + 1) + "|",
    ]
    for cell, runs in results.items():
        lines.append(f"| {cell} | " + " | ".join(_mean_std([r[c] for r in runs]) for c in COLUMNS) + " |")
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=2))
    _plot(exp, out)
    return report


def _plot(exp: ExperimentConfig, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5), dpi=110)
    for cell in exp.cells:
        for i, seed in enumerate(exp.seeds):
            rows = [r for r in read_metrics(out / "runs" / f"{cell.name}-s{seed}") if "losses/loss" in r]
            if not rows:
                continue
            label = cell.name if i == 0 else None
            color = f"C{exp.cells.index(cell)}"
            x = [r["tokens/cumulative"] for r in rows]
            window = exp.success_window * exp.max_rollout_tokens
            axes[0].plot(x, moving_success(rows, window), color=color, alpha=0.7, label=label)
            axes[1].plot(
                x, [r.get("grad/norm", float("nan")) for r in rows], color=color, alpha=0.7, label=label
            )
    axes[0].set_ylabel(f"training success (moving, {exp.success_window:.0%} of budget)")
    axes[1].set_ylabel("gradient norm (pre-clip)")
    for ax in axes:
        ax.set_xlabel("cumulative rollout tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "success_and_grad_norm_vs_tokens.png")
    plt.close(fig)


def run_experiment(exp: ExperimentConfig) -> Path:
    from agent_rl.train import Trainer

    out = Path(exp.out_dir).resolve() / exp.name
    out.mkdir(parents=True, exist_ok=True)
    warm = warm_up_once(exp, out)
    window = exp.success_window * exp.max_rollout_tokens
    start_cfg = _cell_config(exp, exp.cells[0], exp.seeds[0], warm, out)
    start_cfg.run.name = "start"
    start = heldout_success(start_cfg, exp.eval_tasks, final=False)
    results: dict[str, list[dict[str, float]]] = {cell.name: [] for cell in exp.cells}
    for seed in exp.seeds:  # seeds outermost: an interrupted grid still covers every cell
        for cell in exp.cells:
            cfg = _cell_config(exp, cell, seed, warm, out)
            if _finished(cfg):
                print(f"{cell.name} seed {seed}: finished earlier with this config; reusing it", flush=True)
            else:
                shutil.rmtree(cfg.run_dir, ignore_errors=True)  # never append to an unfinished run's logs
                Trainer(cfg).fit()
            summary = summarize_run(read_metrics(cfg.run_dir), exp.target_success, exp.spike_factor, window)
            summary["heldout_success"] = heldout_success(cfg, exp.eval_tasks)
            results[cell.name].append(summary)
            write_report(exp, out, results, start)  # a partial report after every run
            print(
                f"{cell.name} seed {seed}: " + ", ".join(f"{k}={v:.4g}" for k, v in summary.items()),
                flush=True,
            )
    return write_report(exp, out, results, start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agent-rl experiment", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="experiment YAML, e.g. configs/otb_vs_grpo.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    try:
        exp = load_experiment(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as err:
        parser.error(str(err))
    report = run_experiment(exp)
    print(report.read_text())
    print(f"report: {report}")
    return 0
