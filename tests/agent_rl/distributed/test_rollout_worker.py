"""The rollout worker's actor body, built without Ray: every setting it builds from reaches it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from agent_rl import build  # noqa: E402
from agent_rl.config import build_config  # noqa: E402
from agent_rl.distributed.rollout_worker import RolloutWorker, WorkerSpec  # noqa: E402


@pytest.fixture()
def no_sandbox(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "make_sandbox", lambda cfg: "sandbox-placeholder")


@pytest.fixture()
def restore_threads() -> Any:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_worker_spec_carries_the_whole_config(tiny_model_dir: Path) -> None:
    cfg = build_config(
        {}, ["model.device=cuda", "rollout.vllm_gpu_memory_utilization=0.8", "model.cpu_threads=3"]
    )
    spec = WorkerSpec.from_config(cfg, tiny_model_dir)
    assert spec.config == cfg and spec.model_path == str(tiny_model_dir) and spec.num_gpus == 1.0
    assert WorkerSpec.from_config(build_config({}), tiny_model_dir).num_gpus == 0.0


def test_vllm_worker_gets_the_gpu_share_and_cpu_threads(
    tiny_model_dir: Path, recording_vllm: Any, no_sandbox: None, restore_threads: None
) -> None:
    """Both were dropped on the Ray path before: the worker built its engine from its own copy of the
    settings, which lacked them."""
    cfg = build_config(
        {},
        [
            "rollout.engine=vllm",
            "model.device=cuda",
            "rollout.vllm_gpu_memory_utilization=0.8",
            "model.cpu_threads=3",
        ],
    )
    worker = RolloutWorker(WorkerSpec.from_config(cfg, tiny_model_dir), "w0")
    ((path, kwargs),) = recording_vllm.calls
    assert path == str(tiny_model_dir) and kwargs["gpu_memory_utilization"] == 0.8
    assert kwargs["max_model_len"] == build.max_model_len(cfg)
    assert torch.get_num_threads() == 3
    assert worker.tokenizer.pad_token_id is not None


def test_hf_worker_samples_with_its_own_frozen_copy(
    tiny_model_dir: Path, no_sandbox: None, restore_threads: None
) -> None:
    cfg = build_config({}, [f"model.path={tiny_model_dir}", "model.cpu_threads=2", "rollout.max_turns=2"])
    worker = RolloutWorker(WorkerSpec.from_config(cfg, tiny_model_dir), "w0")
    assert torch.get_num_threads() == 2
    assert worker.engine.max_model_len == build.max_model_len(cfg)
    assert not any(p.requires_grad for p in worker.engine.model.parameters())
    env = worker._make_env()
    try:
        assert env.unwrapped.max_turns == 2
    finally:
        env.close()
