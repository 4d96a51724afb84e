"""agent_rl.build: one Config -> parts path for the trainer, Ray workers, eval and experiment."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from agent_rl import build
from agent_rl.config import ConfigError, build_config


def test_vllm_engine_gets_the_configured_gpu_share_on_gpu_only(recording_vllm: Any) -> None:
    gpu = build_config(
        {}, ["rollout.engine=vllm", "model.device=cuda", "rollout.vllm_gpu_memory_utilization=0.7"]
    )
    build.make_engine(gpu, "/models/m", extra={"tensor_parallel_size": 2})
    cpu = build_config(
        {}, ["rollout.engine=vllm", "rollout.max_total_tokens=100", "rollout.max_new_tokens=20"]
    )
    build.make_engine(cpu, "/models/m")
    (path, on_gpu), (_, on_cpu) = recording_vllm.calls
    assert path == "/models/m"
    assert on_gpu["gpu_memory_utilization"] == 0.7 and on_gpu["tensor_parallel_size"] == 2
    assert "gpu_memory_utilization" not in on_cpu and on_cpu["max_model_len"] == 120


def test_hf_engine_needs_the_policy_module() -> None:
    with pytest.raises(ValueError, match="pass model= and tokenizer="):
        build.make_engine(build_config({}), "/models/m")


def test_collector_configs_share_budgets_and_eval_is_greedy() -> None:
    cfg = build_config({}, ["rollout.temperature=0.7", "rollout.top_p=0.9", "rollout.max_turns=3"])
    train, evaluation = build.collector_configs(cfg)
    assert (train.sampling.temperature, train.sampling.top_p) == (0.7, 0.9)
    assert (evaluation.sampling.temperature, evaluation.sampling.top_p) == (0.0, 1.0)
    assert train.max_turns == evaluation.max_turns == 3
    assert train.max_total_tokens == evaluation.max_total_tokens == cfg.rollout.max_total_tokens


def test_env_factory_passes_env_kwargs_and_the_turn_budget() -> None:
    cfg = build_config({}, ["rollout.max_turns=3", "env.kwargs.python_timeout_s=2.5"])
    kwargs = build.env_kwargs(cfg)
    assert kwargs == {"max_turns": 3, "python_timeout_s": 2.5}
    set_turns = build_config({}, ["rollout.max_turns=3", "env.kwargs.max_turns=2"])
    assert build.env_kwargs(set_turns)["max_turns"] == 2  # the env's own setting wins
    env = build.env_factory(cfg, None)()
    try:
        assert env.unwrapped.max_turns == 3 and env.unwrapped.tools["python"].timeout_s == 2.5
    finally:
        env.close()


def test_sandbox_timeout_is_not_a_config_key_any_more() -> None:
    """The tool timeout is the env's `python_timeout_s` (env.kwargs); a second, unread knob is refused."""
    with pytest.raises(ConfigError, match=r"sandbox\.timeout_s: unknown key"):
        build_config({}, ["sandbox.timeout_s=3"])


def _jsonl(path: Path, n: int) -> str:
    path.write_text(
        "".join(json.dumps({"problem": f"{i}+{i}?", "answer": str(2 * i)}) + "\n" for i in range(n))
    )
    return str(path)


def test_training_cycles_a_small_dataset_and_eval_reads_its_held_out_rows(tmp_path: Path) -> None:
    cfg = build_config(
        {},
        [
            "env.id=agent_rl/MathNoTool-v0",
            f"env.kwargs.dataset={_jsonl(tmp_path / 'train.jsonl', 2)}",
            f"env.kwargs.eval_dataset={_jsonl(tmp_path / 'test.jsonl', 3)}",
        ],
    )
    splits = build.task_splits(cfg)
    assert splits.indices("train", 5, first=1, wrap=True) == [1, 0, 1, 0, 1]
    assert splits.reset_options("eval", 2) == [{"task_index": 2, "seed": 2}, {"task_index": 3, "seed": 3}]
    with pytest.raises(ConfigError, match="the 'eval' split has 3 tasks, 4 are needed"):
        splits.indices("eval", 4)


def test_a_missing_split_fails_before_any_model_or_rollout(tmp_path: Path) -> None:
    from agent_rl.train import Trainer

    data = _jsonl(tmp_path / "d.jsonl", 2)
    base = ["env.id=agent_rl/MathNoTool-v0", f"env.kwargs.dataset={data}", "model.path=/nonexistent/model"]
    with pytest.raises(ConfigError, match=r"has no 'eval' task split \(its task source has: train\)"):
        Trainer(build_config({}, [*base, "env.eval_tasks=4"]))
    with pytest.raises(ConfigError, match=r"has no 'demo' task split.*train\.warmup\.steps=0"):
        Trainer(build_config({}, [*base, "env.eval_tasks=0", "train.warmup.steps=2"]))
