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
import hashlib
import json
import math
import os
import shutil
import statistics
from dataclasses import dataclass
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
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Train-config keys this cell changes beyond estimator and N, e.g. {"train.lr": 1.0e-3} for a
    learning-rate frontier or {"env.kwargs.max_depth": 16} for a horizon sweep."""
    label: str | None = None
    """The cell's name in tables and run folders; default `<estimator>-N<group_size>`."""

    @property
    def name(self) -> str:
        return self.label or f"{self.estimator}-N{self.group_size}"


class ExperimentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = "otb_vs_grpo"
    base: dict[str, Any] = Field(default_factory=dict)
    """A train config (same keys as configs/quickstart.yaml) shared by every cell."""
    cells: list[Cell]
    """The main table."""
    sections: dict[str, list[Cell]] = Field(default_factory=dict)
    """Further tables, each compared within itself (e.g. a learning-rate frontier, a horizon
    sweep); a cell may repeat one of the main table's, whose runs are then shared."""
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2])
    max_rollout_tokens: int | None = Field(None, gt=0)
    """The equal-tokens design: every run stops after consuming this many rollout tokens. None is
    the equal-updates design: every run makes `max_steps` updates (N=32 then spends 8x the tokens
    of N=4) and the report adds the equal-tokens view from the curves."""
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
    collapse_drop: float = Field(0.5, gt=0, lt=1)
    collapse_surge: float = Field(10.0, gt=1)
    """A run collapsed if its moving training success ends at or below (1 - collapse_drop) x its
    peak (a peak of at least 0.2), or if a gradient norm above collapse_surge x the run's median is
    not recovered from (the median norm over the last 10% of steps stays above 3x the run's)."""
    min_turn_accuracy: float = Field(0.0, ge=0, le=1)
    """The shared warm-up must reproduce this share of held-out assistant turns greedily
    (`turn_accuracy` of its check, `train.warmup.check_demos`), or the experiment stops with an
    error before any run: a start that cannot copy a tool's output never earns a reward, and a grid
    from it is hours of nothing. Per turn, not the final turn alone: on a long chain the final turn
    also needs the right moment to answer, which is what RL is there to teach."""
    out_dir: str = "reports"
    warmup_threads: int | None = Field(None, ge=1)
    """CPU threads for the shared warm-up (None: the base config's model.cpu_threads). It runs
    alone before any shard, so it may take every core while the runs take one each."""


def load_experiment(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
    """The experiment file with `--set` overrides (the train config's own parser: `base.train.lr=...`)."""
    data = apply_overrides(yaml.safe_load(Path(path).read_text()) or {}, overrides)
    try:
        exp = ExperimentConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"invalid experiment config {str(path)!r}:\n{err}") from None
    build_config(exp.base)  # validate the shared train config early, with its own clear errors
    named: dict[str, Cell] = {}
    for cell in (c for cells in all_sections(exp).values() for c in cells):
        if named.setdefault(cell.name, cell) != cell:  # a shared name means shared runs
            raise ConfigError(f"two different cells are both named {cell.name!r}; give one a label")
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
            f"train.max_rollout_tokens={exp.max_rollout_tokens or 0}",
            f"train.grad_variance_every={exp.grad_variance_every}",
            f"run.out_dir={out / 'runs'}",
            f"run.name={cell.name}-s{seed}",
            "run.resume=false",
            "run.progress=false",
            *(f"{key}={json.dumps(value)}" for key, value in cell.overrides.items()),
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
    from agent_rl.warmup import held_out_accuracy, warm_up

    target = out / "warm_model"
    if (target / "config.json").exists():
        return target
    cfg = build_config(exp.base, [f"run.out_dir={out}", "run.name=warmup", "run.progress=false"])
    tasks = build.task_splits(cfg)
    build.check_splits(cfg, tasks, warmup=True)
    build.set_cpu_threads(exp.warmup_threads or cfg.model.cpu_threads)
    build.seed_everything(cfg.train.seed)
    path = build.resolve_model_path(cfg)
    model, tokenizer = build.load_model_and_tokenizer(path, cfg.model.dtype, cfg.model.device)
    w, record = cfg.train.warmup, {}
    if w.steps:
        sandbox = build.make_sandbox(cfg.sandbox)
        try:
            make_env = build.env_factory(cfg, sandbox)
            losses = warm_up(model, tokenizer, make_env, tasks.indices("demo", w.demos), w, cfg.train.seed)
            record = {"steps": w.steps, "final_loss": statistics.fmean(losses[-20:])}
            if w.check_demos:
                held_out = tasks.indices("demo", w.check_demos, first=w.demos)
                record.update(held_out_accuracy(model, tokenizer, make_env, held_out))
        finally:
            sandbox.close()
    accuracy = record.get("turn_accuracy", 1.0)
    if accuracy < exp.min_turn_accuracy:
        (out / "warmup_failed.json").write_text(json.dumps(record))
        raise RuntimeError(
            f"the shared warm-up reproduces {accuracy:.0%} of held-out assistant turns, below "
            f"min_turn_accuracy={exp.min_turn_accuracy:.0%} ({out / 'warmup_failed.json'}); "
            "no run started. Give it more steps (train.warmup.steps, clean_steps, clean_shortest)."
        )
    model.save_pretrained(target)
    (target / "warmup.json").write_text(json.dumps(record))
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


def update_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if "losses/loss" in r]


def tokens_to(rows: list[dict[str, Any]], level: float, window_tokens: float) -> float:
    """Cumulative rollout tokens when the moving success first reaches `level` (nan: never)."""
    steps = update_rows(rows)
    moving = moving_success(steps, window_tokens)
    return next((float(r["tokens/cumulative"]) for r, m in zip(steps, moving) if m >= level), math.nan)


def collapsed(moving: list[float], norms: list[float], drop: float, surge: float) -> bool:
    """ExperimentConfig.collapse_drop / collapse_surge: success lost, or a gradient blow-up kept."""
    if moving and max(moving) >= 0.2 and moving[-1] <= (1 - drop) * max(moving):
        return True
    if len(norms) < 10:
        return False
    median = statistics.median(norms)
    tail = norms[-max(1, len(norms) // 10) :]
    return max(norms) > surge * median and statistics.median(tail) > 3 * median


def summarize_run(
    rows: list[dict[str, Any]],
    target: float,
    spike_factor: float,
    window_tokens: float,
    *,
    equal_tokens: float = math.inf,
    collapse: tuple[float, float] = (0.5, 10.0),
) -> dict[str, float]:
    """One run's row of the report. `equal_tokens`: the budget of the equal-tokens view, at which
    `success_at_equal_tokens` reads the moving success."""
    steps = update_rows(rows)
    tokens = [r["tokens/cumulative"] for r in steps]
    moving = moving_success(steps, window_tokens)
    norms = [r["grad/norm"] for r in steps if "grad/norm" in r]
    median = statistics.median(norms) if norms else 0.0
    variances = [r["grad/exact_pg_variance"] for r in steps if "grad/exact_pg_variance" in r]
    spearman = [
        r["grad/proxy_spearman"] for r in steps if math.isfinite(r.get("grad/proxy_spearman", math.nan))
    ]
    within = [m for m, t in zip(moving, tokens) if t <= equal_tokens]
    return {
        "tokens_to_target": tokens_to(rows, target, window_tokens),
        "final_success": moving[-1] if steps else math.nan,
        "peak_success": max(moving) if steps else math.nan,
        "success_at_equal_tokens": within[-1] if within else math.nan,
        "tokens_used": float(tokens[-1]) if tokens else 0.0,
        "steps": float(len(steps)),
        "grad_variance": statistics.fmean(variances) if variances else float("nan"),
        "proxy_spearman": statistics.fmean(spearman) if spearman else float("nan"),
        "grad_spikes": float(sum(n > spike_factor * median for n in norms)) if median > 0 else 0.0,
        "collapsed": float(collapsed(moving, norms, *collapse)),
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
    "start_heldout",
    "final_success",
    "success_at_equal_tokens",
    "tokens_to_best_large_n",
    "tokens_to_target",
    "tokens_used",
    "grad_variance",
    "proxy_spearman",
    "grad_spikes",
    "collapsed",
    "steps",
    "minutes",
)
"""Mean ± std over seeds, except `collapsed`, whose mean is the collapse rate."""


def all_sections(exp: ExperimentConfig) -> dict[str, list[Cell]]:
    return {"main": exp.cells, **exp.sections}


@dataclass
class Section:
    """One table's runs, read back from their metrics, with the token scales its views need."""

    name: str
    cells: list[Cell]
    rows: dict[str, dict[int, list[dict[str, Any]]]]
    """cell name -> seed -> that run's metrics (finished runs only)."""
    equal_tokens: float
    """The equal-tokens budget: the experiment's, or the mean tokens of the section's cheapest cell."""

    @classmethod
    def read(cls, exp: ExperimentConfig, name: str, cells: list[Cell], runs: Path, done: set[str]) -> Section:
        rows = {
            c.name: {s: read_metrics(runs / f"{c.name}-s{s}") for s in exp.seeds if f"{c.name}-s{s}" in done}
            for c in cells
        }
        used = [
            statistics.fmean(update_rows(r)[-1]["tokens/cumulative"] for r in per_seed.values())
            for per_seed in rows.values()
            if per_seed
        ]
        budget = exp.max_rollout_tokens or (min(used) if used else 1.0)
        return cls(name, cells, rows, float(budget))

    def large_n_level(self, finals: dict[str, list[float]]) -> float:
        """The best final training success among the section's largest-N cells (nan when every
        cell has the same N): the level `tokens_to_best_large_n` measures against."""
        sizes = {c.group_size for c in self.cells}
        if len(sizes) < 2:
            return math.nan
        best = [
            statistics.fmean(finals[c.name])
            for c in self.cells
            if c.group_size == max(sizes) and finals[c.name]
        ]
        return max(best) if best else math.nan


def summarize_section(exp: ExperimentConfig, section: Section) -> dict[str, list[dict[str, float]]]:
    """Per cell, one summary per finished seed (`seed` names it)."""
    window = exp.success_window * section.equal_tokens
    out = {
        name: [
            {
                "seed": float(seed),
                **summarize_run(
                    rows,
                    exp.target_success,
                    exp.spike_factor,
                    window,
                    equal_tokens=section.equal_tokens,
                    collapse=(exp.collapse_drop, exp.collapse_surge),
                ),
            }
            for seed, rows in per_seed.items()
        ]
        for name, per_seed in section.rows.items()
    }
    level = section.large_n_level({n: [r["final_success"] for r in runs] for n, runs in out.items()})
    for name, per_seed in section.rows.items():
        for summary, rows in zip(out[name], per_seed.values()):
            summary["tokens_to_best_large_n"] = tokens_to(rows, level, window) if level == level else math.nan
    return out


def write_report(
    exp: ExperimentConfig, out: Path, results: dict[str, dict[str, list[dict[str, float]]]]
) -> Path:
    design = (
        f"Equal tokens: every run stops at {exp.max_rollout_tokens} rollout tokens"
        if exp.max_rollout_tokens
        else f"Equal updates: every run makes {exp.max_steps} updates (larger N spends more tokens)"
    )
    lines = [
        f"# {exp.name}",
        "",
        f"{design}; seeds {exp.seeds}; mean ± std over seeds (`collapsed`: the collapse rate). "
        "final_success is the training success averaged over the last "
        f"{exp.success_window:.0%} of the section's equal-tokens budget; success_at_equal_tokens "
        "reads it at that budget (the cheapest cell's tokens). heldout_success / start_heldout: "
        f"greedy success on {exp.eval_tasks} held-out tasks after / before RL.",
        "",
        f"Shared warm-up: {_warmup_line(out / 'warm_model' / 'warmup.json')}.",
    ]
    for section, table in results.items():
        lines += ["", f"## {section}", "", "| cell | " + " | ".join(COLUMNS) + " |"]
        lines.append("|---" * (len(COLUMNS) + 1) + "|")
        for cell, runs in table.items():
            cols = " | ".join(_mean_std([r.get(c, math.nan) for r in runs]) for c in COLUMNS)
            lines.append(f"| {cell} | {cols} |")
        lines.append(f"\n![{section}](plot_{section}.png)")
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=2))
    return report


def _warmup_line(path: Path) -> str:
    record = json.loads(path.read_text()) if path.exists() else {}
    if not record:
        return "none"
    line = f"{record['steps']} supervised steps"
    if "final_loss" in record:
        line += f", final loss {record['final_loss']:.3f}"
    if "final_turn_accuracy" in record:
        line += (
            f", final-turn accuracy on held-out correct demonstrations {record['final_turn_accuracy']:.3f}"
        )
    if "turn_accuracy" in record:
        line += f", per-turn accuracy {record['turn_accuracy']:.3f}"
    return line


def _smooth(values: list[float], k: int) -> list[float]:
    return [statistics.fmean(values[max(0, i - k + 1) : i + 1]) for i in range(len(values))]


def plot_section(exp: ExperimentConfig, section: Section, out: Path) -> Path:
    """Success vs tokens, success vs update and gradient norm vs update, one colour per cell:
    each seed faint, the seeds' smoothed mean bold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4), dpi=110)
    for k, cell in enumerate(section.cells):
        color = f"C{k % 10}"
        runs = [update_rows(r) for r in section.rows[cell.name].values() if update_rows(r)]
        for j, steps in enumerate(runs):
            x = [r["tokens/cumulative"] for r in steps]
            success = [r["env/success_rate"] for r in steps]
            norms = [r.get("grad/norm", math.nan) for r in steps]
            label = cell.name if j == 0 else None
            axes[0].plot(x, _smooth(success, 5), color=color, alpha=0.8, lw=1.2, label=label)
            axes[1].plot(success, color=color, alpha=0.15, lw=0.8)
            axes[2].plot(norms, color=color, alpha=0.15, lw=0.8)
        if runs:
            n = min(len(s) for s in runs)
            mean_success = [statistics.fmean(s[i]["env/success_rate"] for s in runs) for i in range(n)]
            mean_norm = [statistics.fmean(s[i].get("grad/norm", math.nan) for s in runs) for i in range(n)]
            axes[1].plot(_smooth(mean_success, 5), color=color, lw=2, label=cell.name)
            axes[2].plot(_smooth(mean_norm, 5), color=color, lw=2, label=cell.name)
    axes[0].set(xlabel="cumulative rollout tokens", ylabel="training success (5-step mean)")
    axes[1].set(xlabel="update", ylabel="training success (seed mean; seeds faint)")
    axes[2].set(xlabel="update", ylabel="gradient norm, pre-clip")
    if any(y > 0 for line in axes[2].get_lines() for y in line.get_ydata()):
        axes[2].set_yscale("log")
    if section.equal_tokens and not exp.max_rollout_tokens:
        axes[0].axvline(section.equal_tokens, color="grey", ls="--", lw=1, label="equal tokens")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{exp.name}: {section.name}")
    fig.tight_layout()
    path = out / f"plot_{section.name}.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def _train_run(cfg: Config, eval_tasks: int) -> None:
    """Train one run from scratch, then its held-out evaluations (cached for the report)."""
    from agent_rl.train import Trainer

    shutil.rmtree(cfg.run_dir, ignore_errors=True)  # never append to an unfinished run's logs
    Trainer(cfg).fit()
    heldout_success(cfg, eval_tasks)
    _start_success(cfg, eval_tasks)


def _runs(exp: ExperimentConfig) -> list[tuple[Cell, int]]:
    """Every (cell, seed) once, cheapest group size first (an N=32 run costs about 8x an N=4 one);
    within a group size, the main table first, then each section, seeds outermost. So an
    interrupted grid has every small-N cell of the tables it reached before any large-N run."""
    runs: dict[tuple[str, int], tuple[Cell, int]] = {}
    for cells in all_sections(exp).values():
        for seed in exp.seeds:
            for cell in cells:
                runs.setdefault((cell.name, seed), (cell, seed))
    return sorted(runs.values(), key=lambda run: run[0].group_size)  # stable: the order above within one size


def _claim(out: Path, run: str) -> Path | None:
    """Claim a run for this process (None: a live process holds it), so that workers started side
    by side never train the same run. A claim is a file naming its pid, made atomically by a
    hard link; one whose process is gone (a crashed worker) is taken over."""
    claims = out / "claims"
    claims.mkdir(exist_ok=True)
    path, mine = claims / run, claims / f".{run}.{os.getpid()}"
    mine.write_text(str(os.getpid()))
    try:
        for _ in range(2):
            try:
                os.link(mine, path)
                return path
            except FileExistsError:
                try:
                    os.kill(int(path.read_text()), 0)
                    return None  # alive (or not ours to signal: then alive too)
                except PermissionError:
                    return None
                except (ProcessLookupError, ValueError, FileNotFoundError):
                    path.unlink(missing_ok=True)  # its process is gone: take it over
        return None
    finally:
        mine.unlink(missing_ok=True)


def run_experiment(exp: ExperimentConfig, mode: str = "all") -> Path:
    """`all`: train what is missing, then write the report. `worker`: train runs no other
    process has claimed, no report (start one per core; then `report`). `report`: the report
    from the runs finished so far. `warmup`: the shared warm-up only; returns its model folder."""
    if mode not in ("all", "worker", "report", "warmup"):
        raise ValueError(f"mode must be all, worker, report or warmup, got {mode!r}")
    out = Path(exp.out_dir).resolve() / exp.name
    out.mkdir(parents=True, exist_ok=True)
    warm = warm_up_once(exp, out)
    if mode == "warmup":
        return warm
    done: set[str] = set()
    for cell, seed in _runs(exp):
        cfg = _cell_config(exp, cell, seed, warm, out)
        if _finished(cfg):
            print(f"{cfg.run.name}: finished earlier with this config; reusing it", flush=True)
        elif mode != "report":
            claim = _claim(out, cfg.run.name)
            if claim is None:
                print(f"{cfg.run.name}: being trained by another process; not in this report", flush=True)
                continue
            try:
                _train_run(cfg, exp.eval_tasks)
            finally:
                claim.unlink(missing_ok=True)
        if _finished(cfg):
            done.add(cfg.run.name)
    if mode == "worker":
        return out / "report.md"
    results = {}
    for name, cells in all_sections(exp).items():
        section = Section.read(exp, name, cells, out / "runs", done)
        results[name] = summarize_section(exp, section)
        for cell in cells:
            for summary in results[name][cell.name]:
                cfg = _cell_config(exp, cell, int(summary["seed"]), warm, out)
                summary["heldout_success"] = heldout_success(cfg, exp.eval_tasks)
                summary["start_heldout"] = _start_success(cfg, exp.eval_tasks)
        plot_section(exp, section, out)
    return write_report(exp, out, results)


def _start_success(cfg: Config, tasks: int) -> float:
    """The warmed-up policy's held-out success on cfg's tasks: one evaluation per distinct env
    setting (a horizon sweep's depths differ), cached in a `start-<hash>` run folder."""
    env_key = hashlib.sha256(json.dumps(cfg.env.model_dump(), sort_keys=True).encode()).hexdigest()[:10]
    start = cfg.model_copy(deep=True)
    start.run.name = f"start-{env_key}"
    return heldout_success(start, tasks, final=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agent-rl experiment", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="experiment YAML, e.g. configs/otb_vs_grpo.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--mode",
        choices=("all", "worker", "report", "warmup"),
        default="all",
        help="all: train what is missing, then report; warmup: the shared warm-up only (run it "
        "first when starting workers); worker: train runs no other worker has claimed, no report "
        "(one per core, side by side); report: a report of the runs finished so far",
    )
    args = parser.parse_args(argv)
    try:
        exp = load_experiment(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as err:
        parser.error(str(err))
    result = run_experiment(exp, args.mode)
    if args.mode == "warmup":
        print(f"warmed-up model: {result}")
    elif args.mode != "worker":
        print(result.read_text())
        print(f"report: {result}")
    return 0
