"""`agent-rl inspect`: policy and tool tokens are drawn differently; advantages become colour."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from rich.text import Text

from agent_rl import inspect as inspect_cli
from agent_rl.rollout.trajectory import Trajectory, TrajectoryWriter, TurnRecord


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def episode(tokenizer: Any) -> Trajectory:
    prompt = tokenizer.encode(
        "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    policy = tokenizer.encode("POLICYTEXT", add_special_tokens=False)
    tool = tokenizer.encode("\n<|im_start|>tool\nTOOLTEXT<|im_end|>\n", add_special_tokens=False)
    ids = policy + tool + policy
    mask = [1] * len(policy) + [0] * len(tool) + [1] * len(policy)
    return Trajectory(
        traj_id="0-0-0",
        group_id=0,
        sample_index=0,
        task=7,
        prompt_ids=prompt,
        response_ids=ids,
        response_mask=mask,
        log_probs=[-0.1 * m for m in mask],
        token_rewards=[0.0] * (len(ids) - 1) + [1.0],
        turns=[
            TurnRecord(policy_tokens=len(policy), tool_tokens=len(tool)),
            TurnRecord(policy_tokens=len(policy), reward=1.0),
        ],
        reward=1.0,
        num_policy_tokens=2 * len(policy),
        num_tool_tokens=len(tool),
        stop_reason="terminated",
    )


def run(argv: list[str]) -> tuple[int, str]:
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, color_system="truecolor", width=200)
    code = inspect_cli.main(argv, console=console)
    return code, Text.from_ansi(buffer.getvalue()).plain  # the text a reader sees, styles removed


def test_policy_and_tool_tokens_are_styled_differently(
    tmp_path: Path, tokenizer: Any, tiny_model_dir: Path
) -> None:
    traj = episode(tokenizer)
    TrajectoryWriter(tmp_path, tokenizer_path=str(tiny_model_dir)).write(2, [traj])
    code, out = run([str(tmp_path)])
    assert code == 0
    assert "terminated" in out and "POLICY" in out and "TOOL" in out
    text = inspect_cli.render_tokens(traj, tokenizer)
    styles = {str(span.style) for span in text.spans}
    assert {inspect_cli.POLICY_STYLE, inspect_cli.TOOL_STYLE, inspect_cli.PROMPT_STYLE} <= styles
    tool_text = "".join(
        text.plain[s.start : s.end] for s in text.spans if str(s.style) == inspect_cli.TOOL_STYLE
    )
    assert "TOOLTEXT" in tool_text and "POLICY" not in tool_text


def test_advantages_become_colour(tmp_path: Path, tokenizer: Any) -> None:
    traj = episode(tokenizer)
    traj.advantages = [(1.0 if i < 3 else -2.0) * m for i, m in enumerate(traj.response_mask)]
    text = inspect_cli.render_tokens(traj, tokenizer, show_prompt=False)
    policy_styles = [str(s.style) for s, m in zip(text.spans, traj.response_mask, strict=True) if m]
    assert inspect_cli.advantage_style(1.0, 2.0) in policy_styles
    assert inspect_cli.advantage_style(-2.0, 2.0) in policy_styles
    assert "on rgb(220,0,0)" in inspect_cli.advantage_style(-2.0, 2.0)  # strongest red for the largest |A|
    TrajectoryWriter(tmp_path).write(0, [traj])
    code, out = run([str(tmp_path), "--step", "0", "--tokenizer", tokenizer.name_or_path])
    assert code == 0 and "advantage > 0" in out


def test_bad_arguments_say_what_exists(tmp_path: Path, tokenizer: Any) -> None:
    code, out = run([str(tmp_path)])
    assert code == 1 and "no trajectories" in out
    TrajectoryWriter(tmp_path).write(4, [episode(tokenizer)])
    code, out = run([str(tmp_path), "--step", "9"])
    assert code == 1 and "available steps: 4" in out
    code, out = run([str(tmp_path), "--index", "5"])
    assert code == 1 and "holds 1 trajectories" in out
    code, out = run([str(tmp_path)])  # no tokenizer recorded: ids are shown raw
    assert code == 0 and f"[{traj_first_id(tokenizer)}]" in out


def traj_first_id(tokenizer: Any) -> int:
    return episode(tokenizer).prompt_ids[0]
