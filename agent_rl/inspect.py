"""`agent-rl inspect RUN_DIR`: read a run's trajectories in the terminal.

Why: masks and rewards are the part of agent RL that is easiest to get silently wrong, and a
table of numbers does not show it. Here every token is drawn in its role's colour (prompt,
policy-sampled, env/tool), so a tool token under the policy mask or a reward on the wrong turn
is visible at a glance; when the learner wrote per-token `advantages`, policy tokens are shaded
by them instead (green positive, red negative, stronger = larger).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from agent_rl.rollout.trajectory import Trajectory, read_trajectories, step_files

PROMPT_STYLE = "grey50"
POLICY_STYLE = "bold cyan"
TOOL_STYLE = "yellow"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agent-rl inspect", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path, help="a run directory (with rollouts/step_*.jsonl|parquet)")
    p.add_argument("--step", type=int, default=None, help="training step to open (default: the latest)")
    p.add_argument("--index", type=int, default=0, help="trajectory index within the step (default 0)")
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer dir (default: the one recorded in rollouts/meta.json)"
    )
    p.add_argument("--no-prompt", action="store_true", help="hide the prompt tokens")
    p.add_argument("--width", type=int, default=None, help="console width (default: the terminal's)")
    return p


def _load_tokenizer(run_dir: Path, explicit: str | None) -> Any:
    path = explicit
    meta = run_dir / "rollouts" / "meta.json"
    if path is None and meta.exists():
        path = json.loads(meta.read_text()).get("tokenizer_path")
    if path is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _piece(tokenizer: Any, token_id: int) -> str:
    if tokenizer is None:
        return f"[{token_id}]"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def advantage_style(value: float, scale: float) -> str:
    """Background colour for one advantage: green above zero, red below, intensity by |value|/scale."""
    strength = min(abs(value) / scale, 1.0) if scale > 0 else 0.0
    level = int(40 + 180 * strength)
    rgb = (0, level, 0) if value >= 0 else (level, 0, 0)
    return f"white on rgb({rgb[0]},{rgb[1]},{rgb[2]})"


def render_tokens(traj: Trajectory, tokenizer: Any, show_prompt: bool = True) -> Text:
    """The episode as coloured text: one span per token in its role's style."""
    text = Text()
    if show_prompt:
        for tok in traj.prompt_ids:
            text.append(_piece(tokenizer, tok), style=PROMPT_STYLE)
    advantages = traj.advantages
    scale = max((abs(a) for a in advantages), default=0.0) if advantages else 0.0
    for i, (tok, m) in enumerate(zip(traj.response_ids, traj.response_mask, strict=True)):
        if not m:
            style = TOOL_STYLE
        elif advantages is not None:
            style = advantage_style(advantages[i], scale)
        else:
            style = POLICY_STYLE
        text.append(_piece(tokenizer, tok), style=style)
    return text


def summary_table(traj: Trajectory) -> Table:
    table = Table(title=f"trajectory {traj.traj_id}", show_header=False, box=None)
    rows = [
        ("group / sample", f"{traj.group_id} / {traj.sample_index}"),
        ("task", json.dumps(traj.task)),
        ("reward", f"{traj.reward:g}"),
        ("stop reason", traj.stop_reason + (" (truncated)" if traj.truncated else "")),
        ("infra error", traj.infra_error or "-"),
        ("turns", str(traj.num_turns)),
        (
            "tokens",
            f"prompt {len(traj.prompt_ids)}, policy {traj.num_policy_tokens}, tool {traj.num_tool_tokens}",
        ),
        ("timings (s)", ", ".join(f"{k} {v:.3f}" for k, v in traj.timings.items())),
    ]
    for key, value in rows:
        table.add_row(Text(key, style="bold"), value)
    return table


def turns_table(traj: Trajectory) -> Table:
    table = Table(title="turns")
    for column in ("#", "policy", "tool", "finish", "reward", "tool cut", "info"):
        table.add_column(column)
    for i, turn in enumerate(traj.turns):
        info = json.dumps(turn.info)
        table.add_row(
            str(i + 1),
            str(turn.policy_tokens),
            str(turn.tool_tokens),
            turn.finish_reason,
            f"{turn.reward:g}",
            str(turn.tool_truncated_tokens) if turn.tool_truncated_tokens else "-",
            info if len(info) <= 60 else info[:57] + "...",
        )
    return table


def legend(traj: Trajectory) -> Text:
    text = Text("legend: ")
    text.append("prompt", style=PROMPT_STYLE)
    text.append("  ")
    if traj.advantages is None:
        text.append("policy (mask 1)", style=POLICY_STYLE)
    else:
        text.append("policy, advantage > 0", style=advantage_style(1.0, 1.0))
        text.append(" ")
        text.append("policy, advantage < 0", style=advantage_style(-1.0, 1.0))
    text.append("  ")
    text.append("env/tool (mask 0)", style=TOOL_STYLE)
    return text


def main(argv: list[str] | None = None, console: Console | None = None) -> int:
    args = _parser().parse_args(argv)
    console = console or Console(width=args.width)
    files = step_files(args.run_dir)
    if not files:
        console.print(
            f"[red]no trajectories under {args.run_dir / 'rollouts'}[/red] (expected step_*.jsonl or .parquet)"
        )
        return 1
    if args.step is None:
        path = files[-1]
    else:
        matches = [f for f in files if f.stem == f"step_{args.step:06d}"]
        if not matches:
            steps = ", ".join(str(int(f.stem.split("_")[1])) for f in files)
            console.print(f"[red]no step {args.step}[/red]; available steps: {steps}")
            return 1
        path = matches[0]
    trajectories = read_trajectories(path)
    if not 0 <= args.index < len(trajectories):
        console.print(
            f"[red]index {args.index} out of range[/red]: {path.name} holds {len(trajectories)} trajectories"
        )
        return 1
    traj = trajectories[args.index]
    tokenizer = _load_tokenizer(args.run_dir, args.tokenizer)
    console.print(f"[bold]{path}[/bold]  ({len(trajectories)} trajectories; showing index {args.index})")
    console.print(summary_table(traj))
    console.print(turns_table(traj))
    console.print(legend(traj))
    console.print(render_tokens(traj, tokenizer, show_prompt=not args.no_prompt))
    return 0
