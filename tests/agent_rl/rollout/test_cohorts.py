"""Lock-step cohorts (CollectorConfig.cohorts): the engine generates one cohort's turn while another
cohort's env steps run, and every engine call is still a function of the episodes' state."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from agent_rl.rollout.collector import Collector, CollectorConfig, cohort_of
from agent_rl.rollout.engine import SamplingParams
from tests.agent_rl.rollout.conftest import HF_TOLERANCE
from tests.agent_rl.rollout.helpers import ScriptedEngine, ScriptedToolEnv

REPLIES = ["print(1 + 1)", "the tool said it", "\\boxed{2}"]


class Timeline:
    """Start and end times of engine calls and env steps, recorded from any thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[float, float, int]] = []
        self.steps: list[tuple[float, float]] = []

    def overlapping_calls(self) -> int:
        """Engine calls that ran while at least one env step was running."""
        return sum(any(s0 < c1 and c0 < s1 for s0, s1 in self.steps) for c0, c1, _ in self.calls)


class SlowEngine(ScriptedEngine):
    """A scripted engine whose every call takes `call_s`, recording when it ran."""

    def __init__(self, tokenizer: Any, timeline: Timeline, call_s: float) -> None:
        super().__init__(tokenizer, REPLIES)
        self.timeline, self.call_s = timeline, call_s

    def generate(self, prompts: Any, params: Any) -> Any:
        started = time.perf_counter()
        time.sleep(self.call_s)
        out = super().generate(prompts, params)
        with self.timeline.lock:
            self.timeline.calls.append((started, time.perf_counter(), len(prompts)))
        return out


class SleepyToolEnv(ScriptedToolEnv):
    """A tool call that takes `step_s` (a sleeping sandbox), recording when it ran."""

    def __init__(self, timeline: Timeline, step_s: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.timeline, self.step_s = timeline, step_s

    def step(self, action: str):
        started = time.perf_counter()
        time.sleep(self.step_s)
        with self.timeline.lock:
            self.timeline.steps.append((started, time.perf_counter()))
        return super().step(action)


def test_cohorts_are_contiguous_balanced_blocks() -> None:
    assert [cohort_of(i, 6, 2) for i in range(6)] == [0, 0, 0, 1, 1, 1]
    assert [cohort_of(i, 5, 2) for i in range(5)] == [0, 0, 0, 1, 1]
    assert [cohort_of(i, 2, 4) for i in range(2)] == [0, 1]  # never an empty cohort
    assert [cohort_of(i, 4, 1) for i in range(4)] == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="cohorts"):
        CollectorConfig(cohorts=0)


@pytest.mark.parametrize("cohorts", [1, 2])
def test_engine_runs_during_tool_calls_only_with_cohorts(tokenizer: Any, cohorts: int) -> None:
    """Tool calls of 0.15 s and engine calls of 0.1 s: with two cohorts the engine generates one
    cohort's turn while the other's tools run; with one, every call waits for all tools (lock-step),
    so no call overlaps a step. Either way each call holds exactly one whole cohort."""
    timeline = Timeline()
    engine = SlowEngine(tokenizer, timeline, call_s=0.1)
    config = CollectorConfig(max_turns=3, cohorts=cohorts)
    trajs = Collector(
        engine, tokenizer, lambda: SleepyToolEnv(timeline, 0.15, episode_turns=3), config
    ).collect([1, 2], group_size=2)
    assert all(t.stop_reason == "terminated" and t.num_turns == 3 for t in trajs)
    assert [size for _, _, size in timeline.calls] == [4 // cohorts] * (3 * cohorts)
    if cohorts == 1:
        assert timeline.overlapping_calls() == 0
    else:
        # Every call after the first (cohort 0's turn 1, before any tool ran) overlaps a tool call.
        assert timeline.overlapping_calls() >= len(timeline.calls) - 2


def test_cohorts_give_the_lockstep_tokens(hf_engine: Any, tokenizer: Any) -> None:
    """The same seed with 1 and 2 cohorts: per-row seeds make the sampled tokens the same; the
    log-probs differ only by the float rounding of batches of another size (padding, matmul
    shapes). Bit-identity is promised across runs of one config, not across cohort counts."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8)
    runs = []
    for cohorts in (1, 2):
        config = CollectorConfig(sampling=sampling, max_turns=3, max_total_tokens=400, cohorts=cohorts)
        collector = Collector(hf_engine, tokenizer, lambda: ScriptedToolEnv(episode_turns=3), config)
        runs.append(collector.collect([1, 2, 3], group_size=2, seed=11))
    one, two = runs
    for a, b in zip(one, two, strict=True):
        assert a.response_ids == b.response_ids and a.response_mask == b.response_mask
        assert max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs, strict=True)) < HF_TOLERANCE


def test_episodes_of_different_lengths_all_finish(tokenizer: Any) -> None:
    """Episodes ending after 1..4 turns, three cohorts of uneven size: a cohort whose episodes have
    all ended drops out of the rotation, and the others keep being served to the end."""
    engine = ScriptedEngine(tokenizer, REPLIES)
    lengths = {seed: 1 + seed % 4 for seed in range(7)}

    class VaryingEnv(ScriptedToolEnv):
        def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
            self.episode_turns = lengths[int(seed or 0)]
            return super().reset(seed=seed, options=options)

    config = CollectorConfig(max_turns=5, cohorts=3, lockstep_stall_s=2.0)
    collector = Collector(engine, tokenizer, VaryingEnv, config)
    started = time.perf_counter()
    trajs = collector.collect(list(range(7)), group_size=1)
    assert time.perf_counter() - started < 2.0  # no stall fallback was needed
    assert [t.num_turns for t in trajs] == [lengths[s] for s in range(7)]
    assert all(t.stop_reason == "terminated" for t in trajs)
    assert collector.last_stats.lockstep_stalls == 0
    assert sum(engine.batch_sizes) == sum(lengths.values())
