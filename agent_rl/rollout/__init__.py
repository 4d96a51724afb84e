"""Rollout: engines that sample token ids, and a collector that turns env episodes into trajectories.

The trainer's entry points:
    engine = HFEngine.from_pretrained(path)            # or VLLMEngine(path, ...)
    collector = Collector(engine, tokenizer, "agent_rl/PythonMath-v0", CollectorConfig(...))
    trajectories = collector.collect(tasks, group_size)
    batch = agent_rl.batch.collate(trajectories, pad_id=tokenizer.pad_token_id)  # for the learner
    engine.update_weights(model.state_dict())          # after each optimiser step

Engines are imported lazily (vLLM is optional and heavy).
"""

from __future__ import annotations

from typing import Any

from agent_rl.rollout.chat_delta import ChatDelta, ChatTemplateError
from agent_rl.rollout.collector import Collector, CollectorConfig, CollectStats
from agent_rl.rollout.engine import Completion, Engine, SamplingParams
from agent_rl.rollout.trajectory import (
    Trajectory,
    TrajectoryWriter,
    TurnRecord,
    read_trajectories,
    step_files,
)

__all__ = [
    "ChatDelta",
    "ChatTemplateError",
    "CollectStats",
    "Collector",
    "CollectorConfig",
    "Completion",
    "Engine",
    "HFEngine",
    "SamplingParams",
    "Trajectory",
    "TrajectoryWriter",
    "TurnRecord",
    "VLLMEngine",
    "read_trajectories",
    "step_files",
]


def __getattr__(name: str) -> Any:
    if name == "HFEngine":
        from agent_rl.rollout.hf_engine import HFEngine

        return HFEngine
    if name == "VLLMEngine":
        from agent_rl.rollout.vllm_engine import VLLMEngine

        return VLLMEngine
    raise AttributeError(f"module 'agent_rl.rollout' has no attribute {name!r}")
