"""Chain tasks: a hidden keyed chain that only the lookup tool can follow, one hop per turn."""

from __future__ import annotations

import json

import gymnasium as gym
import pytest

import envs  # noqa: F401 - registers the built-in ids
from envs.demos import play
from envs.tasks.chain import MAX_DEPTH, ChainEnv, ChainTasks, LookupTool, next_key, scripted_turns, walk
from envs.tasks.splits import EVAL, TRAIN


def test_tasks_are_reproducible_and_depths_vary_within_range() -> None:
    tasks = ChainTasks(min_depth=1, max_depth=MAX_DEPTH, seed=3)
    again = ChainTasks(min_depth=1, max_depth=MAX_DEPTH, seed=3)
    depths = [tasks[i].metadata["depth"] for i in range(200)]
    assert [tasks[i] for i in range(20)] == [again[i] for i in range(20)]
    assert min(depths) <= 3 and max(depths) >= 30 and all(1 <= d <= MAX_DEPTH for d in depths)
    task = tasks[7]
    assert task.metadata["keys"] == walk(tasks.secret, task.metadata["start"], task.metadata["depth"])
    assert task.answer == str(task.metadata["keys"][-1])
    assert ChainTasks(seed=4)[7].answer != ChainTasks(seed=3)[7].answer  # the seed changes the chain


def test_bad_depths_are_rejected() -> None:
    with pytest.raises(ValueError, match="max_depth"):
        ChainTasks(min_depth=1, max_depth=MAX_DEPTH + 1)
    with pytest.raises(ValueError, match="min_depth"):
        ChainTasks(min_depth=5, max_depth=4)


def test_held_out_split_is_disjoint_from_training() -> None:
    tasks = ChainTasks(size=1000)
    train, held_out = tasks.splits[TRAIN], tasks.splits[EVAL]
    assert set(train).isdisjoint(held_out) and len(held_out) > 0
    starts = {tasks[i].metadata["start"] for i in train[:200]}
    assert sum(tasks[i].metadata["start"] in starts for i in held_out[:200]) < 5


def test_lookup_follows_the_chain_and_rejects_bad_keys() -> None:
    tool = LookupTool("s3cret", noise_lines=3)
    out = tool.call({"key": 123456})
    assert out.ok and out.text.splitlines()[-1] == f"next: {next_key('s3cret', 123456)}"
    assert len(out.text.splitlines()) == 4  # 3 distractors, then the answer line
    for bad in ({"key": 12}, {"key": "123456"}, {"key": True}, {}):
        result = tool.call(bad)
        assert not result.ok and result.text.startswith("Error")


@pytest.mark.parametrize("depth", [1, 16, 32])
def test_scripted_chain_scores_one_after_depth_turns(depth: int) -> None:
    env = ChainEnv(min_depth=depth, max_depth=depth, noise_lines=2)
    task = env.tasks[0]
    episode = play(env, scripted_turns(task), options={"task_index": 0})
    assert episode.terminated and episode.total_reward == 1.0
    assert len(episode.rewards) == depth + 1  # one lookup per turn, then the answer
    assert episode.rewards[:-1] == [0.0] * depth  # sparse: only the answer is paid


def test_turns_cannot_be_skipped() -> None:
    env = ChainEnv(min_depth=4, max_depth=4, noise_lines=0)
    task = env.tasks[0]
    early = play(
        env, [*scripted_turns(task)[:2], f"\\boxed{{{task.metadata['keys'][1]}}}"], options={"task_index": 0}
    )
    assert early.terminated and early.total_reward == 0.0  # answering after 2 of 4 hops is wrong
    # Two calls in one turn: the second cannot know its key, and is not run anyway.
    env.reset(options={"task_index": 0})
    first, second = scripted_turns(task)[:2]
    obs, _, _, _, info = env.step(first + second)
    assert len(info["tool_calls"]) == 1 and "at most 1 tool calls per turn" in obs[1]["content"]


def test_long_tool_output_is_cut_with_a_marker_and_recorded() -> None:
    env = ChainEnv(min_depth=2, max_depth=2, noise_lines=200, max_output_chars=256)
    env.reset(options={"task_index": 0})
    obs, _, _, _, info = env.step(scripted_turns(env.tasks[0])[0])
    assert "output truncated" in obs[0]["content"]
    assert "next: " in obs[0]["content"]  # the tail (the answer line) survives the cut
    assert info["tool_calls"][0]["output_truncated"] is True


def test_tool_call_budget_truncates_with_a_reason() -> None:
    env = ChainEnv(min_depth=8, max_depth=8, noise_lines=0, max_tool_calls=3, max_turns=32)
    episode = play(env, scripted_turns(env.tasks[0]), options={"task_index": 0})
    assert episode.truncated and episode.infos[-1]["truncated_reason"] == "tool_budget"
    assert episode.total_reward == 0.0


def test_registered_id_makes_a_deep_chain_env() -> None:
    env = gym.make("agent_rl/ChainLookup-v0", max_depth=32, min_depth=32)
    base = env.unwrapped
    assert base.max_turns == 33 and base.max_tool_calls == 32
    _, info = env.reset(seed=1)
    assert info["family"] == "chain" and base.task.metadata["depth"] == 32
    schema = json.dumps(base.tool_schemas)
    assert "lookup" in schema
    env.close()


def test_warm_up_demonstrations_play_through_the_env() -> None:
    """The correct demonstration scores 1 after depth lookups; the flawed one answers an earlier
    hop's real key (so it still teaches copying) and scores 0, with stop points spread over hops."""
    from envs.demos import demonstration, hallucinated_demonstration

    env = ChainEnv(min_depth=1, max_depth=8, noise_lines=1)
    stops = set()
    for i in range(40):
        task = env.tasks[i]
        good = demonstration(env, i)
        assert good.total_reward == 1.0 and good.terminated
        assert sum(m["role"] == "tool" for m in good.messages) == task.metadata["depth"]
        bad = hallucinated_demonstration(env, i)
        lookups = sum(m["role"] == "tool" for m in bad.messages)
        assert bad.total_reward == 0.0 and lookups < task.metadata["depth"]
        seen = [task.metadata["start"], *task.metadata["keys"]]
        assert bad.messages[-1]["content"] == env.format.render_call("declare", {"key": seen[lookups]})
        stops.add(lookups)
    assert {0, 1, 2} <= stops  # early and late mistakes alike


def test_declare_answers_and_ends_the_episode_and_a_boxed_key_counts_too() -> None:
    env = ChainEnv(min_depth=2, max_depth=2)
    task = env.tasks[0]
    first = env.format.render_call("lookup", {"key": task.metadata["start"]})
    for answer, reward in (
        (env.format.render_call("declare", {"key": int(task.answer)}), 1.0),
        (env.format.render_call("declare", {"key": task.metadata["start"]}), 0.0),
        (f"The key is \\boxed{{{task.answer}}}.", 1.0),
    ):
        episode = play(
            env,
            [first, env.format.render_call("lookup", {"key": task.metadata["keys"][0]}), answer],
            options={"task_index": 0},
        )
        assert episode.terminated and episode.total_reward == reward
        assert sum(m["role"] == "tool" for m in episode.messages) == 2  # declare itself never runs
    with pytest.raises(ValueError, match="answer_tool"):
        ChainEnv(answer_tool="submit")
