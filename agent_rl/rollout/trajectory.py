"""The trajectory record: token-exact, self-checking and serialisable (`agent_rl.batch.collate` packs it).

Why tokens are the single source of truth: the learner scores `prompt_ids + response_ids` and
trusts `response_mask` to say which of those the policy sampled. Every list in the response part
has one entry per response token, and `check()` enforces that (the collector calls it every turn).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

StopReason = str
"""Why an episode ended: 'terminated' (the env said so), 'env_truncated' (the env's own limit),
'max_turns', 'max_total_tokens' (our budgets) or 'infra_error'."""

TRUNCATION_REASONS = frozenset({"env_truncated", "max_turns", "max_total_tokens"})


@dataclass
class TurnRecord:
    """What happened in one policy turn (sample, then env step)."""

    policy_tokens: int
    """Tokens the policy sampled this turn (all mask 1)."""
    tool_tokens: int = 0
    """Tokens of the env's reply appended after the turn (all mask 0)."""
    finish_reason: str = ""
    """The engine's finish reason for this turn: 'stop' or 'length'."""
    reward: float = 0.0
    """The env's reward for this step; placed on this turn's last policy token."""
    tool_truncated_tokens: int = 0
    """Tool-output tokens cut by max_tool_tokens (0 = nothing cut)."""
    info: dict[str, Any] = field(default_factory=dict)
    """The env's info dict for this step, made JSON-safe."""


@dataclass
class Trajectory:
    """One episode, as the learner consumes it. Response lists are aligned token by token."""

    traj_id: str
    group_id: int
    """Index of the task within the collect() call; samples of one task share it."""
    sample_index: int
    """Which of the group's N samples this is."""
    task: Any
    """The seed or task id the env was reset with (JSON-safe)."""
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    """Everything after the prompt: policy turns and the env's replies, in order."""
    response_mask: list[int] = field(default_factory=list)
    """1 where the policy sampled the token, 0 for template/tool tokens."""
    log_probs: list[float] = field(default_factory=list)
    """Sampling log-probs (agent_rl.rollout.engine convention); 0.0 where the mask is 0."""
    token_rewards: list[float] = field(default_factory=list)
    """Step rewards on the last policy token of their turn (the outcome thus on the last one)."""
    turns: list[TurnRecord] = field(default_factory=list)
    reward: float = 0.0
    """Sum of the env's rewards (= sum(token_rewards))."""
    num_policy_tokens: int = 0
    num_tool_tokens: int = 0
    stop_reason: StopReason = ""
    infra_error: str | None = None
    """Set when the env/sandbox/verifier failed; the learner should exclude this sample."""
    reset_info: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds: 'generate_wait' (waiting for the engine), 'env' (reset + steps), 'total'."""
    advantages: list[float] | None = None
    """Per response token, filled by the learner before writing (for `agent-rl inspect`)."""
    policy_version: int | None = None
    """How many updates the weights that sampled this episode had seen (set by the trainer; None
    outside training). The learner's version minus this is the sample's staleness: 0 when
    synchronous, 1 under one-step-off-policy pipelining (`rollout.async_steps`, docs/async.md)."""

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def truncated(self) -> bool:
        return self.stop_reason in TRUNCATION_REASONS

    @property
    def valid(self) -> bool:
        """False when an infrastructure failure, not the policy, decided the outcome."""
        return self.infra_error is None

    def check(self, *, deep: bool = True) -> None:
        """Raise if the response lists disagree. ``deep=False`` checks the lengths only (O(1)): the
        collector's per-turn check, since reading every token after every turn is O(turns x tokens)
        over a long episode; the batch builder runs the deep check once per trajectory."""
        n = len(self.response_ids)
        lengths = {
            "response_mask": len(self.response_mask),
            "log_probs": len(self.log_probs),
            "token_rewards": len(self.token_rewards),
        }
        bad = {k: v for k, v in lengths.items() if v != n}
        if bad:
            raise AssertionError(f"trajectory {self.traj_id}: {n} response ids but {bad}")
        if self.num_policy_tokens + self.num_tool_tokens != n:
            raise AssertionError(
                f"trajectory {self.traj_id}: {n} response ids but {self.num_policy_tokens} sampled + "
                f"{self.num_tool_tokens} tool/template tokens"
            )
        if not deep:
            return
        if any(m not in (0, 1) for m in self.response_mask):
            raise AssertionError(f"trajectory {self.traj_id}: response_mask has values other than 0/1")
        masked = sum(self.response_mask)
        if masked != self.num_policy_tokens or n - masked != self.num_tool_tokens:
            raise AssertionError(
                f"trajectory {self.traj_id}: mask marks {masked} tokens but {self.num_policy_tokens} were sampled "
                f"({n - masked} unmasked vs {self.num_tool_tokens} tool/template tokens)"
            )
        if any(lp != 0.0 for lp, m in zip(self.log_probs, self.response_mask, strict=True) if m == 0):
            raise AssertionError(f"trajectory {self.traj_id}: non-zero log-prob on a mask-0 token")
        if self.advantages is not None and len(self.advantages) != n:
            raise AssertionError(
                f"trajectory {self.traj_id}: {len(self.advantages)} advantages for {n} tokens"
            )

    def to_record(self) -> dict[str, Any]:
        """A JSON-safe dict (also the Parquet row); derived fields are included for readers."""
        rec = asdict(self)
        rec["num_turns"] = self.num_turns
        rec["truncated"] = self.truncated
        return rec

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> Trajectory:
        names = {f.name for f in fields(cls)}
        data = {k: v for k, v in rec.items() if k in names}
        data["turns"] = [TurnRecord(**t) for t in data.get("turns") or []]
        return cls(**data)


def json_safe(value: Any) -> Any:
    """Turn env info (numpy scalars, tuples, exceptions, NaN) into something json.dumps accepts."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [json_safe(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        try:
            return json_safe(value.item())
        except (ValueError, RuntimeError):
            pass
    if hasattr(value, "tolist"):
        return json_safe(value.tolist())
    return repr(value)


class TrajectoryWriter:
    """Writes each training step's trajectories to RUN_DIR/rollouts/step_XXXXXX.jsonl (or .parquet).

    One file per step keeps writes atomic per step (temp file + rename) and lets `agent-rl inspect`
    open any step without scanning the others.
    """

    def __init__(self, run_dir: str | Path, *, fmt: str = "jsonl", tokenizer_path: str | None = None) -> None:
        if fmt not in ("jsonl", "parquet"):
            raise ValueError(f"fmt must be 'jsonl' or 'parquet', got {fmt!r}")
        self.dir = Path(run_dir) / "rollouts"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fmt = fmt
        if tokenizer_path is not None:
            # Lets `agent-rl inspect` decode ids without being told where the tokenizer is.
            (self.dir / "meta.json").write_text(json.dumps({"tokenizer_path": str(tokenizer_path)}))

    def write(self, step: int, trajectories: Sequence[Trajectory]) -> Path:
        path = self.dir / f"step_{step:06d}.{self.fmt}"
        tmp = path.with_suffix(path.suffix + ".tmp")
        records = [t.to_record() for t in trajectories]
        if self.fmt == "jsonl":
            with tmp.open("w") as f:
                for rec in records:
                    f.write(json.dumps(rec) + "\n")
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            # Nested, free-form dicts (env info, timings) go in as JSON text: Parquet needs one schema.
            rows = [
                {k: json.dumps(v) if k in _JSON_COLUMNS else v for k, v in rec.items()} for rec in records
            ]
            pq.write_table(pa.Table.from_pylist(rows), tmp)
        tmp.replace(path)
        return path


_JSON_COLUMNS = ("task", "turns", "reset_info", "timings")


def read_trajectories(path: str | Path) -> list[Trajectory]:
    """Read a step file written by TrajectoryWriter (format from the suffix)."""
    path = Path(path)
    if path.suffix == ".jsonl":
        with path.open() as f:
            return [Trajectory.from_record(json.loads(line)) for line in f if line.strip()]
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
        return [
            Trajectory.from_record({k: json.loads(v) if k in _JSON_COLUMNS else v for k, v in row.items()})
            for row in rows
        ]
    raise ValueError(f"{path}: expected a .jsonl or .parquet trajectory file")


def step_files(run_dir: str | Path) -> list[Path]:
    """All step files of a run, oldest first."""
    folder = Path(run_dir) / "rollouts"
    return sorted(p for p in folder.glob("step_*") if p.suffix in (".jsonl", ".parquet"))
