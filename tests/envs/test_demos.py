from __future__ import annotations

import gymnasium as gym
import pytest

import envs
from envs import GeneratedTasks, scripted_single_turn, scripted_solution

EPISODE_TOKEN_BUDGET = 200


def test_scripted_solution_is_the_formulaic_transcript() -> None:
    task = envs.Task(
        "Compute 123456789 * 987654321.", "121932631112635269", solution_code="print(123456789 * 987654321)"
    )
    assert scripted_solution(task) == [
        "```python\nprint(123456789 * 987654321)\n```",
        "\\boxed{121932631112635269}",
    ]
    hermes = scripted_solution(task, "hermes")[0]
    assert hermes.startswith("<tool_call>") and '"code": "print(123456789 * 987654321)"' in hermes
    calc = scripted_solution(task, "hermes", tool="calculator")[0]
    assert '"expression": "123456789 * 987654321"' in calc
    assert scripted_single_turn(task) == ["\\boxed{121932631112635269}"]
    with pytest.raises(ValueError, match="solution_code"):
        scripted_solution(envs.Task("q", "1"))


@pytest.mark.parametrize("family", list(envs.FAMILIES))
def test_scripted_demonstrations_score_one_in_the_real_sandbox(family: str, sandbox) -> None:
    env = envs.PythonMathEnv(sandbox=sandbox, families=(family,), difficulty=2)
    for i in range(2):
        episode = envs.demonstration(env, i)
        assert episode.total_reward == 1.0, episode.messages
        assert "infra_error" not in episode.infos[-1]
    env.close()


def test_easy_episode_fits_the_tiny_models_context(sandbox) -> None:
    from agent_rl.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    env = gym.make("agent_rl/PythonArithEasy-v0", sandbox=sandbox)
    lengths = []
    for i in range(20):
        episode = envs.demonstration(env, i)
        assert episode.total_reward == 1.0
        ids = tokenizer.apply_chat_template(episode.messages, tokenize=True)
        lengths.append(len(ids["input_ids"] if hasattr(ids, "keys") else ids))
    env.close()
    assert max(lengths) <= EPISODE_TOKEN_BUDGET, lengths


def test_difficulty_zero_matches_the_easy_env() -> None:
    env = gym.make("agent_rl/PythonArithEasy-v0")
    obs, _ = env.reset(options={"task_index": 0})
    assert obs[1]["content"] == GeneratedTasks(families=("multiply",), difficulty=0)[0].problem
    assert obs[1]["content"].startswith("Compute ") and len(obs[0]["content"]) < 50
    env.close()


@pytest.mark.parametrize("answer", ["528556", "100000", "530000", "99", "7", "-4200", "3/4"])
def test_confident_guess_is_plausible_and_wrong(answer: str) -> None:
    from envs.demos import confident_guess

    guess = confident_guess(answer)
    assert guess != answer and guess == confident_guess(answer)  # wrong, and always the same
    if answer.lstrip("-").isdigit() and len(answer) > 2:
        # same sign and length, two significant digits: a round estimate of this task's answer
        assert len(guess) == len(answer) and guess.startswith("-") == answer.startswith("-")
        assert set(guess.lstrip("-")[2:]) == {"0"}


def test_hallucinated_demonstration_makes_the_output_up_and_scores_zero(sandbox) -> None:
    from envs.demos import confident_guess, hallucinated_demonstration

    env = gym.make("agent_rl/PythonArithEasy-v0", sandbox=sandbox)
    task = env.unwrapped.tasks[5]
    episode = hallucinated_demonstration(env, 5)
    env.close()
    assert episode.terminated and episode.total_reward == 0.0
    assert episode.infos[-1]["skipped_calls"] == 1  # the call was written but never ran
    assistant = [m["content"] for m in episode.messages if m["role"] == "assistant"]
    guess = confident_guess(task.answer)
    assert len(assistant) == 1 and assistant[0].startswith("```python\n")
    assert assistant[0].endswith(f"```output\n{guess}\n```\n\\boxed{{{guess}}}")
    assert not any(m["role"] == "tool" for m in episode.messages)
