"""Fixtures shared by the agent_rl tests."""

from __future__ import annotations

from typing import Any

import pytest


class RecordingVLLM:
    """Stands in for VLLMEngine: records the arguments the build path gives it."""

    calls: list[tuple[str, dict[str, Any]]] = []  # noqa: RUF012

    def __init__(self, model_path: str, **kwargs: Any) -> None:
        RecordingVLLM.calls.append((model_path, kwargs))


@pytest.fixture()
def recording_vllm(monkeypatch: pytest.MonkeyPatch) -> type[RecordingVLLM]:
    """VLLMEngine replaced by a recorder (no vLLM start-up): what would the engine have been given?"""
    import agent_rl.rollout.vllm_engine as vllm_engine

    RecordingVLLM.calls = []
    monkeypatch.setattr(vllm_engine, "VLLMEngine", RecordingVLLM)
    return RecordingVLLM
