"""The collector: token-exact multi-turn bookkeeping, budgets, infrastructure failures, overlap."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from agent_rl.batch import collate
from agent_rl.rollout.chat_delta import ChatDelta
from agent_rl.rollout.collector import Collector, CollectorConfig
from agent_rl.rollout.engine import SamplingParams
from tests.agent_rl.rollout.helpers import FlakySandbox, SandboxEnv, ScriptedEngine, ScriptedToolEnv
from tests.agent_rl.rollout.test_chat_delta import STRIP_THINK_TEMPLATE

REPLIES = ["print(1 + 1)", "the tool said it", "\\boxed{2}"]


def scripted(tokenizer: Any, replies: list[str] = REPLIES, **kwargs: Any) -> ScriptedEngine:
    return ScriptedEngine(tokenizer, replies, **kwargs)


def policy_segments(traj: Any) -> list[list[int]]:
    """Maximal runs of mask-1 tokens, i.e. the policy's turns."""
    segments: list[list[int]] = []
    previous = 0
    for tok, m in zip(traj.response_ids, traj.response_mask, strict=True):
        if m and not previous:
            segments.append([])
        if m:
            segments[-1].append(tok)
        previous = m
    return segments


def test_multi_turn_groups_masks_and_rewards(tokenizer: Any) -> None:
    engine = scripted(tokenizer)
    envs: list[ScriptedToolEnv] = []

    def factory() -> ScriptedToolEnv:
        envs.append(ScriptedToolEnv(episode_turns=3, reward_per_step=0.25, outcome_reward=1.0))
        return envs[-1]

    trajs = Collector(engine, tokenizer, factory, CollectorConfig(max_turns=5)).collect(
        [10, 20], group_size=3
    )
    assert [(t.group_id, t.sample_index) for t in trajs] == [(g, s) for g in range(2) for s in range(3)]
    for t in trajs:
        t.check()
        assert t.stop_reason == "terminated" and not t.truncated and t.valid
        assert t.num_turns == 3
        expected = [[*tokenizer.encode(r, add_special_tokens=False), tokenizer.eos_token_id] for r in REPLIES]
        assert policy_segments(t) == expected  # sampled ids verbatim, and only they carry mask 1
        assert t.num_policy_tokens == sum(map(len, expected))
        assert t.num_tool_tokens == len(t.response_ids) - t.num_policy_tokens
        assert all(lp == -0.5 for lp, m in zip(t.log_probs, t.response_mask, strict=True) if m)
        # Step rewards sit on each turn's last policy token; the outcome on the very last one.
        ends = [
            i
            for i in range(len(t.response_mask))
            if t.response_mask[i] and (i + 1 == len(t.response_mask) or not t.response_mask[i + 1])
        ]
        assert [t.token_rewards[i] for i in ends] == [0.25, 0.25, 1.25]
        assert sum(t.token_rewards) == pytest.approx(t.reward) == 1.75  # quarters: exact in binary
        assert t.response_mask[-1] == 1  # the episode ends on a policy token
    assert all(env.closed for env in envs)
    assert all(env.received == ["print(1 + 1)", "the tool said it", "\\boxed{2}"] for env in envs)


def test_history_is_never_retokenised(tokenizer: Any) -> None:
    engine = scripted(tokenizer)
    trajs = Collector(engine, tokenizer, lambda: ScriptedToolEnv(episode_turns=3), CollectorConfig()).collect(
        [1], 1
    )
    traj = trajs[0]
    full = traj.prompt_ids + traj.response_ids
    # Every prefix the engine saw is a prefix of the final ids: nothing earlier was ever rewritten.
    assert len(engine.prefixes) == 3
    for prefix in engine.prefixes:
        assert full[: len(prefix)] == prefix
    # With the append-only ChatML template the result equals a one-shot render of the conversation.
    messages = [{"role": "system", "content": "You are a test."}, {"role": "user", "content": "question 1"}]
    for turn, reply in enumerate(REPLIES):
        messages.append({"role": "assistant", "content": reply})
        if turn < 2:
            messages.append({"role": "tool", "content": f"tool says {turn + 1}"})
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.decode(full, skip_special_tokens=False) + "\n" == rendered
    # The template's newline after <|im_end|> belongs to the env's (mask 0) part.
    eos_positions = [i for i, tok in enumerate(traj.response_ids) if tok == tokenizer.eos_token_id]
    first_eos = eos_positions[0]
    assert traj.response_mask[first_eos] == 1 and traj.response_mask[first_eos + 1] == 0
    assert tokenizer.decode([traj.response_ids[first_eos + 1]]) == "\n"


def test_turn_without_eos_gets_the_closing_from_the_template(tokenizer: Any) -> None:
    engine = scripted(tokenizer, append_eos=False)
    traj = Collector(engine, tokenizer, lambda: ScriptedToolEnv(episode_turns=2), CollectorConfig()).collect(
        [1], 1
    )[0]
    first_tool = traj.response_mask.index(0)
    assert traj.response_ids[first_tool] == tokenizer.eos_token_id  # the closing eos is not the policy's
    assert traj.turns[0].finish_reason == "length"


def test_non_append_only_template_keeps_sampled_reasoning(tokenizer: Any) -> None:
    replies = ["<think>need 1+1</think>print(1 + 1)", "<think>it printed 2</think>\\boxed{2}"]
    engine = scripted(tokenizer, replies)
    config = CollectorConfig(chat_template=STRIP_THINK_TEMPLATE)
    traj = Collector(engine, tokenizer, lambda: ScriptedToolEnv(episode_turns=2), config).collect([1], 1)[0]
    full = traj.prompt_ids + traj.response_ids
    for prefix in engine.prefixes:
        assert full[: len(prefix)] == prefix
    text = tokenizer.decode(traj.response_ids, skip_special_tokens=False)
    assert "<think>need 1+1</think>" in text  # what the policy sampled, not what a re-render would show
    assert policy_segments(traj)[0][:-1] == tokenizer.encode(replies[0], add_special_tokens=False)


def test_max_turns_budget_is_recorded(tokenizer: Any) -> None:
    engine = scripted(tokenizer)
    traj = Collector(
        engine, tokenizer, lambda: ScriptedToolEnv(episode_turns=10), CollectorConfig(max_turns=2)
    ).collect([1], 1)[0]
    assert traj.num_turns == 2
    assert traj.stop_reason == "max_turns" and traj.truncated
    assert traj.response_mask[-1] == 1  # no dangling env reply after the last turn


def test_max_total_tokens_budget_never_exceeded(tokenizer: Any) -> None:
    engine = scripted(tokenizer, ["a fairly long assistant reply with many tokens in it " * 2])
    prompt_len = len(
        tokenizer.apply_chat_template(
            [{"role": "system", "content": "You are a test."}, {"role": "user", "content": "question 1"}],
            tokenize=False,
            add_generation_prompt=True,
        )
    )  # characters >= tokens, so this leaves room for the prompt
    config = CollectorConfig(max_total_tokens=prompt_len + 30, max_turns=10)
    traj = Collector(engine, tokenizer, lambda: ScriptedToolEnv(episode_turns=10), config).collect([1], 1)[0]
    assert traj.stop_reason == "max_total_tokens" and traj.truncated
    assert len(traj.prompt_ids) + len(traj.response_ids) <= config.max_total_tokens
    assert traj.turns[-1].finish_reason == "length" or "dropped_reply_tokens" in traj.turns[-1].info


def test_tool_output_truncated_with_marker(tokenizer: Any) -> None:
    engine = scripted(tokenizer)
    long_reply = "output line 1234567890\n" * 30
    factory = lambda: ScriptedToolEnv(episode_turns=2, tool_reply=long_reply)  # noqa: E731
    traj = Collector(engine, tokenizer, factory, CollectorConfig(max_tool_tokens=8)).collect([1], 1)[0]
    assert traj.turns[0].tool_truncated_tokens > 0
    tool_text = tokenizer.decode(
        [t for t, m in zip(traj.response_ids, traj.response_mask, strict=True) if not m]
    )
    assert f"[... {traj.turns[0].tool_truncated_tokens} tokens truncated]" in tool_text
    untruncated = ChatDelta(tokenizer).delta_ids([{"role": "tool", "content": long_reply}], True)
    assert traj.turns[0].tool_tokens < len(untruncated) / 4


def test_env_that_raises_is_an_infra_failure_not_a_zero_reward(tokenizer: Any) -> None:
    engine = scripted(tokenizer)
    made = iter([ScriptedToolEnv(episode_turns=3, raise_on_turn=2), ScriptedToolEnv(episode_turns=3)])
    trajs = Collector(engine, tokenizer, lambda: next(made), CollectorConfig(env_workers=1)).collect([1], 2)
    crashed = [t for t in trajs if t.infra_error]
    assert len(crashed) == 1
    assert "verifier crashed on turn 2" in crashed[0].infra_error
    assert crashed[0].stop_reason == "infra_error" and crashed[0].num_turns == 2
    crashed[0].check()
    healthy = next(t for t in trajs if not t.infra_error)
    assert healthy.stop_reason == "terminated" and healthy.reward == 1.0
    batch = collate(trajs, pad_id=tokenizer.pad_token_id)
    assert batch.valid.tolist() == [t.infra_error is None for t in trajs]


def test_env_that_fails_to_reset_or_reports_infra_error(tokenizer: Any) -> None:
    engine = scripted(tokenizer)
    reset_fail = Collector(engine, tokenizer, lambda: ScriptedToolEnv(raise_on_reset=True)).collect([1], 1)[0]
    assert reset_fail.infra_error and "reset exploded" in reset_fail.infra_error
    assert reset_fail.response_ids == [] and not reset_fail.valid
    reported = Collector(engine, tokenizer, lambda: ScriptedToolEnv(infra_error_on_turn=1)).collect([1], 1)[0]
    assert reported.infra_error == "env.step: sandbox unreachable"
    reported.check()


def test_env_truncation_and_bad_tasks(tokenizer: Any) -> None:
    engine = scripted(tokenizer)
    traj = Collector(engine, tokenizer, lambda: ScriptedToolEnv(episode_turns=5, truncate_on_turn=1)).collect(
        [1], 1
    )[0]
    assert traj.stop_reason == "env_truncated" and traj.truncated
    with pytest.raises(TypeError, match="int seed or a mapping"):
        Collector(engine, tokenizer, ScriptedToolEnv).collect(["not a task"], 1)  # type: ignore[list-item]


def test_reset_options_come_from_mapping_tasks(tokenizer: Any) -> None:
    engine = scripted(tokenizer)
    traj = Collector(engine, tokenizer, lambda: ScriptedToolEnv(episode_turns=1)).collect(
        [{"seed": 3, "question": "what is 6*7"}], 1
    )[0]
    assert "what is 6*7" in tokenizer.decode(traj.prompt_ids)
    assert traj.reset_info == {"seed": 3}


def test_waiting_sequences_are_batched_and_env_steps_overlap(tokenizer: Any) -> None:
    class SlowEnv(ScriptedToolEnv):
        def step(self, action: str):
            time.sleep(0.2)
            return super().step(action)

    engine = scripted(tokenizer)
    collector = Collector(
        engine, tokenizer, lambda: SlowEnv(episode_turns=2), CollectorConfig(batch_wait_s=0.05, cohorts=1)
    )
    trajs = collector.collect([1, 2, 3, 4], group_size=2)
    env_total = sum(t.timings["env"] for t in trajs)
    assert env_total > 8 * 2 * 0.2 * 0.9  # 16 sleeping steps...
    assert collector.last_stats.wall_s < env_total / 3  # ...ran side by side, not one after another
    assert max(engine.batch_sizes) == 8  # one engine call served every waiting episode
    assert collector.last_stats.engine_calls <= 4


def test_tiny_model_multi_turn_log_probs_have_no_drift(
    engine: Any, reference_model: Any, tokenizer: Any, tolerance: float
) -> None:
    """The headline property: a trainer forward over the recorded ids reproduces the sampler's log-probs."""
    config = CollectorConfig(
        sampling=SamplingParams(temperature=0.8, max_new_tokens=16), max_turns=3, max_total_tokens=400
    )
    trajs = Collector(engine, tokenizer, lambda: ScriptedToolEnv(episode_turns=3), config).collect(
        [1, 2], group_size=2
    )
    batch = collate(trajs, pad_id=tokenizer.pad_token_id)
    r_len = batch.response_length
    with torch.no_grad():
        logits = reference_model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
        ).logits.float()  # (B, L, V)
    scores = (logits[:, -r_len - 1 : -1] / 0.8).log_softmax(-1)  # (B, R, V)
    recomputed = scores.gather(-1, batch.responses[..., None])[..., 0]  # (B, R)
    mask = batch.policy_mask
    assert mask.sum() == sum(t.num_policy_tokens for t in trajs) > 0
    diff = (recomputed - batch.sampler_log_probs)[mask].abs().max()
    assert diff < tolerance, diff
    assert (batch.sampler_log_probs[~mask] == 0).all()
    for t in trajs:
        t.check()
        tool_ids = [tok for tok, m in zip(t.response_ids, t.response_mask, strict=True) if not m]
        assert "tool says" in tokenizer.decode(tool_ids)  # tool text is present, and only under mask 0
        assert t.num_turns >= 1 and t.valid


def test_sandbox_going_away_mid_rollout(hf_engine: Any, tokenizer: Any) -> None:
    sandbox = FlakySandbox()
    try:
        config = CollectorConfig(sampling=SamplingParams(temperature=1.0, max_new_tokens=8), max_turns=4)
        factory = lambda: SandboxEnv(sandbox, stop_after=5, episode_turns=4)  # noqa: E731
        trajs = Collector(hf_engine, tokenizer, factory, config).collect([1, 2, 3], group_size=2)
    finally:
        sandbox.server.server_close()
    assert 5 <= sandbox.calls < 6 * 4  # calls in flight at shutdown may still be served
    failed = [t for t in trajs if t.infra_error]
    assert failed, "every episode needs more than 5 sandbox calls in total, so some must see it gone"
    for t in failed:
        assert "sandbox unreachable" in t.infra_error
        assert t.stop_reason == "infra_error"
        t.check()
    batch = collate(trajs, pad_id=tokenizer.pad_token_id)
    assert batch.valid.sum() == len(trajs) - len(failed)


def test_env_reply_missing_is_flagged(tokenizer: Any) -> None:
    class SilentEnv(ScriptedToolEnv):
        def step(self, action: str):
            _obs, reward, terminated, truncated, info = super().step(action)
            return [], reward, terminated, truncated, info

    traj = Collector(scripted(tokenizer), tokenizer, lambda: SilentEnv(episode_turns=3)).collect([1], 1)[0]
    assert traj.infra_error is not None and "no new messages" in traj.infra_error
    traj.check()


def test_engine_failure_propagates_and_closes_envs(tokenizer: Any) -> None:
    class BrokenEngine(ScriptedEngine):
        def generate(self, prompts: Any, params: Any) -> Any:
            raise RuntimeError("engine died")

    envs: list[ScriptedToolEnv] = []

    def factory() -> ScriptedToolEnv:
        envs.append(ScriptedToolEnv())
        return envs[-1]

    with pytest.raises(RuntimeError, match="engine died"):
        Collector(BrokenEngine(tokenizer, REPLIES), tokenizer, factory).collect([1, 2], 2)
    assert len(envs) == 4 and all(env.closed for env in envs)


@pytest.mark.parametrize("cohorts", [1, 2])
def test_deterministic_batching_does_not_depend_on_env_timing(
    hf_engine: Any, tokenizer: Any, monkeypatch: pytest.MonkeyPatch, cohorts: int
) -> None:
    """Two collects with one seed while tool calls take random, different times: the same engine
    calls (same rows in the same order), hence bit-identical tokens and log-probs. Batched float
    arithmetic depends on who shares a batch, so this is what makes a run reproducible. With two
    cohorts the calls alternate between the cohorts' halves, still in a fixed order."""
    import random

    jitter = random.Random()  # unseeded on purpose: timings differ between the two collects

    class JitterEnv(ScriptedToolEnv):
        def step(self, action: str):
            time.sleep(jitter.random() * 0.03)
            return super().step(action)

    calls: list[list[tuple[int, ...]]] = []
    generate = hf_engine.generate

    def recording(prompts, params):
        calls.append([tuple(p) for p in prompts])
        return generate(prompts, params)

    monkeypatch.setattr(hf_engine, "generate", recording)
    config = CollectorConfig(
        sampling=SamplingParams(temperature=1.0, max_new_tokens=8),
        max_turns=3,
        max_total_tokens=400,
        cohorts=cohorts,
    )
    assert config.deterministic  # the default
    runs = []
    for _ in range(2):
        calls.clear()
        trajs = Collector(hf_engine, tokenizer, lambda: JitterEnv(episode_turns=3), config).collect(
            [1, 2, 3], group_size=2, seed=7
        )
        runs.append(([list(c) for c in calls], [(t.response_ids, t.log_probs) for t in trajs]))
    (calls_a, trajs_a), (calls_b, trajs_b) = runs
    assert [len(c) for c in calls_a] == [6 // cohorts] * (3 * cohorts)  # lock-step turns per cohort
    assert calls_a == calls_b
    assert trajs_a == trajs_b


def test_lockstep_falls_back_instead_of_deadlocking_on_a_held_resource(tokenizer: Any) -> None:
    """One sandbox slot for two episodes: the second waits in reset for a slot the first holds
    until it ends, and the first waits for a batch that lock-step would hold for the second."""
    import threading

    slot = threading.Semaphore(1)

    class OneSlotEnv(ScriptedToolEnv):
        def reset(self, *, seed=None, options=None):
            slot.acquire()
            return super().reset(seed=seed, options=options)

        def close(self) -> None:
            slot.release()

    config = CollectorConfig(max_turns=3, lockstep_stall_s=0.5)
    collector = Collector(scripted(tokenizer), tokenizer, lambda: OneSlotEnv(episode_turns=2), config)
    trajs = collector.collect([1], group_size=2)
    assert [t.infra_error for t in trajs] == [None, None] and all(t.num_turns == 2 for t in trajs)
    assert collector.last_stats.lockstep_stalls == 1


def test_engine_calls_run_on_one_thread_across_collects_never_two_at_once(tokenizer: Any) -> None:
    """One engine thread per collector: a thread per collect() made its calls allocate from a fresh
    malloc arena (page faults), and two concurrent collect_async() calls could run the engine at once."""
    import asyncio
    import threading

    class Recording(ScriptedEngine):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.threads: set[int] = set()
            self.running = self.most_running = 0
            self.lock = threading.Lock()

        def generate(self, prompts: Any, params: Any) -> Any:
            with self.lock:
                self.threads.add(threading.get_ident())
                self.running += 1
                self.most_running = max(self.most_running, self.running)
            try:
                time.sleep(0.01)  # room for a second call to start, were another thread serving it
                return super().generate(prompts, params)
            finally:
                with self.lock:
                    self.running -= 1

    engine = Recording(tokenizer, REPLIES)
    collector = Collector(engine, tokenizer, lambda: ScriptedToolEnv(episode_turns=2), CollectorConfig())
    collector.collect([1, 2], group_size=2)
    collector.collect([3], group_size=2)

    async def two_at_once() -> list[Any]:
        return await asyncio.gather(collector.collect_async([4], 2), collector.collect_async([5], 2))

    assert all(len(trajs) == 2 for trajs in asyncio.run(two_at_once()))
    assert len(engine.threads) == 1 and threading.get_ident() not in engine.threads
    assert engine.most_running == 1
