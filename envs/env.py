"""ToolEnv: a multi-turn Gymnasium environment where the action is the assistant's text.

API (Gymnasium's exact signatures):

- ``reset(seed=None, options=None) -> (obs, info)``: picks a task (``options["task_index"]``,
  ``options["task"]``, or drawn from ``np_random``), opens each tool's per-episode state (the
  Python sandbox session) and returns the first messages: ``[system, user]``.
- ``step(action: str) -> (obs, reward, terminated, truncated, info)``:

  - ``obs``: the NEW messages the agent sees next (a tool result names its tool and has an id), e.g.
    ``[{"role": "tool", "name": "python", "tool_call_id": "000100000", "content": "```output\\n42\\n```"}]``;
    ``[]`` when the episode ends.
  - ``reward``: the step's reward (float). The outcome reward (1/0) is paid on the final step;
    format penalties on the step where they happen. Return = sum over steps.
  - ``terminated``: a final answer (``\\boxed{}`` / ``<answer>``) was given, or the turn made no
    tool call (the agent stopped).
  - ``truncated``: the turn limit or tool-call budget ran out, or the infrastructure failed.
  - ``info``: ``turn``, ``tool_calls`` (name, arguments, execution metadata per call),
    ``parse_errors``, on the last step ``verification`` (predicted, expected, correct, method),
    and ``infra_error`` when the sandbox or verifier (not the agent) failed: such an episode says
    nothing about the policy and a trainer should drop it.

A turn with a final answer ends the episode even if it also contains tool calls (they are not
run, and ``info["skipped_calls"]`` counts them): the answer was committed before any output.
On the last allowed turn, calls are not run either (nobody would read their output).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any, SupportsFloat

import gymnasium as gym
from gymnasium.envs.registration import EnvSpec

from envs.answers import extract_final_answer
from envs.parsing import ParsedItem, ParsedTurn, ToolFormat, get_format
from envs.rewards import RewardConfig
from envs.spaces import Message, MessagesSpace, TextSpace
from envs.tasks.base import ListTasks, Task, TaskSource
from envs.tools.base import Tool, ToolInfraError, truncate_output
from envs.tools.python import PythonTool, Shared
from envs.verify import Verification, default_verifier

ANSWER_INSTRUCTION = "Put the final answer in \\boxed{}."
TOOL_LISTINGS = ("system_prompt", "native")
INVALID_CALL_NAME = "invalid_tool_call"

Verifier = Callable[[str | None, str], Verification]


class ResetNeeded(RuntimeError):
    """`step` was called before `reset` or after the episode ended."""


class ToolEnv(gym.Env[list[Message], str]):
    """Multi-turn tool use over a task source; see the module docstring for the full API.

    Args:
        tasks: an indexable task source (GeneratedTasks, load_tasks(...), a list of Task).
        tools: the tools the agent may call; None = one PythonTool on `sandbox`; [] = no tools
            (single-turn: every turn ends the episode).
        tool_format: "code" (```python / ```output), "hermes" (<tool_call> JSON), "llama3_json"
            (Llama 3.1/3.2 JSON calls), "mistral" or "mistral_v11" ([TOOL_CALLS]); see envs.parsing.
        system_prompt: None builds a short one from the format; "" sends no system message.
        tool_listing: where the tools' JSON schemas go. "system_prompt": the default system prompt
            lists them (the hermes format's "Tools:" line). "native": the prompt leaves them out and
            `reset` returns them as ``info["tools"]``, for the caller to pass as
            ``apply_chat_template(tools=...)`` so the model sees its own trained tool block. Only a
            format whose calls are JSON function calls (all but "code") has a list to hand over; with the
            ```python format "native" changes nothing.
        max_turns: assistant turns before truncation.
        max_tool_calls: tool calls per episode before truncation (the budget).
        max_calls_per_turn: further calls in one turn get an error message instead of running.
        max_output_chars: each tool result is cut to this many characters, with a marker.
        answer_tool: the name of one of `tools` whose call gives the final answer (its first
            argument, verified like a boxed answer; the episode ends there), the "submit" tool of
            agent benchmarks. None: answers are boxed in prose only. A boxed answer always counts.
        observation_role: role of result messages; "user" for chat templates without `tool`.
        verifier: (predicted or None, gold) -> Verification; None = the process-wide MathVerifier
            (exact numbers, symbolic equivalence in a worker with a 5 s timeout). A custom
            verifier is called in-process: give it its own timeout (e.g. a MathVerifier).
        sandbox: backend for the default PythonTool: None or "local" (one LocalSandbox shared
            by the process), an "http(s)://" sandbox service URL, or an object with `.session()`
            (shared, never copied, when Gymnasium copies the env's spec).
        python_timeout_s: wall-clock limit of each code execution.
        sandbox_limits: per-session limit overrides for the backend (e.g. {"memory_mb": 512}).
    """

    # Text has no frame rate; render_fps is declared only because Gymnasium's checker asks for it.
    metadata: dict[str, Any] = {"render_modes": ["ansi"], "render_fps": 1}  # noqa: RUF012

    def __init__(
        self,
        tasks: TaskSource | Sequence[Task],
        tools: Sequence[Tool] | None = None,
        *,
        tool_format: str | ToolFormat = "code",
        system_prompt: str | None = None,
        tool_listing: str = "system_prompt",
        max_turns: int = 4,
        max_tool_calls: int = 8,
        max_calls_per_turn: int = 2,
        max_output_chars: int = 512,
        answer_tool: str | None = None,
        observation_role: str = "tool",
        reward: RewardConfig | None = None,
        verifier: Verifier | None = None,
        sandbox: Any = None,
        python_timeout_s: float | None = 5.0,
        sandbox_limits: dict[str, Any] | None = None,
        max_action_chars: int = 16_384,
        render_mode: str | None = None,
    ) -> None:
        self._check_budgets(max_turns, max_tool_calls, max_calls_per_turn, max_output_chars, render_mode)
        self.tasks: TaskSource = ListTasks(tasks) if isinstance(tasks, (list, tuple)) else tasks
        if len(self.tasks) == 0:
            raise ValueError("the task source is empty")
        if tools is None:
            tools = [PythonTool(sandbox, timeout_s=python_timeout_s, session_limits=sandbox_limits)]
        self.tools: dict[str, Tool] = {t.name: t for t in tools}
        if len(self.tools) != len(tools):
            raise ValueError("tool names must be unique")
        self.format = get_format(tool_format)
        self.answer_tool = answer_tool
        self._check_tools()
        if tool_listing not in TOOL_LISTINGS:
            raise ValueError(f"tool_listing must be one of {TOOL_LISTINGS}, got {tool_listing!r}")
        self.tool_listing = tool_listing
        if system_prompt is None:
            system_prompt = self.default_system_prompt()
        self.system_prompt = system_prompt
        self.max_turns = max_turns if self.tools else 1
        self.max_tool_calls = max_tool_calls
        self.max_calls_per_turn = max_calls_per_turn
        self.max_output_chars = max_output_chars
        self.observation_role = observation_role
        self.reward_config = reward or RewardConfig()
        self.verifier: Verifier = verifier or default_verifier()
        self.render_mode = render_mode
        self.action_space = TextSpace(max_action_chars)
        self.observation_space = MessagesSpace()

        self.task: Task | None = None
        self.task_index: int | None = None
        self.messages: list[Message] = []
        """The whole conversation so far (system, user, assistant, tool...), for rendering/logs."""
        self.turn = 0
        self.tool_calls_used = 0
        self._done = True

    def _check_budgets(
        self,
        max_turns: int,
        max_tool_calls: int,
        max_calls_per_turn: int,
        max_output_chars: int,
        render_mode: str | None,
    ) -> None:
        if max_turns < 1 or max_tool_calls < 0 or max_calls_per_turn < 1 or max_output_chars < 64:
            raise ValueError(
                "need max_turns >= 1, max_tool_calls >= 0, max_calls_per_turn >= 1, max_output_chars >= 64"
            )
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be None or one of {self.metadata['render_modes']}")

    # ----- Gymnasium spec ----------------------------------------------------------------------
    _spec: EnvSpec | None = None

    def _check_tools(self) -> None:
        if self.answer_tool is not None and self.answer_tool not in self.tools:
            raise ValueError(f"answer_tool {self.answer_tool!r} is not one of the tools {sorted(self.tools)}")
        if self.tools and self.format.name == "code" and "python" not in self.tools:
            raise ValueError(
                'tool_format="code" runs ```python blocks: include a PythonTool, or use "hermes"'
            )

    @property
    def spec(self) -> EnvSpec | None:  # type: ignore[override]
        return self._spec

    @spec.setter
    def spec(self, value: EnvSpec | None) -> None:
        # gymnasium.make stores the make() kwargs in the spec, and Gymnasium deep-copies the spec
        # (wrappers' `env.spec`, `spec.make()`). A live sandbox backend holds locks and processes and
        # cannot be copied; it is meant to be shared anyway, so wrap it in `Shared`.
        if value is not None:
            backend = value.kwargs.get("sandbox")
            if backend is not None and not isinstance(backend, (str, Shared)):
                value.kwargs["sandbox"] = Shared(backend)
        self._spec = value

    # ----- prompts -------------------------------------------------------------------------
    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        """Function schemas of the tools, for chat templates that take `tools=`."""
        return [t.schema() for t in self.tools.values()]

    @property
    def native_tools(self) -> list[dict[str, Any]] | None:
        """The schemas the caller passes as `tools=` to the chat template (``info["tools"]`` at reset),
        or None when the system prompt describes the tools (see `tool_listing`)."""
        if self.tool_listing == "native" and self.format.native_tools and self.tools:
            return self.tool_schemas
        return None

    def default_system_prompt(self) -> str:
        if not self.tools:
            return ANSWER_INSTRUCTION
        listed = [] if self.native_tools else self.tool_schemas
        return f"{self.format.instructions(listed)} {ANSWER_INSTRUCTION}"

    def prompt_messages(self, task: Task) -> list[Message]:
        """The episode's opening messages; override to change how a task is presented."""
        first = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*first, {"role": "user", "content": task.problem}]

    # ----- Gymnasium API -------------------------------------------------------------------
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        super().reset(seed=seed)
        options = options or {}
        self._close_tools()
        if "task" in options:
            task, index = options["task"], None
            if not isinstance(task, Task):
                raise TypeError(f'options["task"] must be a Task, got {type(task).__name__}')
        else:
            index = options.get("task_index")
            if index is None:
                index = int(self.np_random.integers(len(self.tasks)))
            if isinstance(index, numbers.Integral) and not isinstance(index, bool):
                index = int(index)  # numpy integers from a sampler are fine
            if not isinstance(index, int) or not 0 <= index < len(self.tasks):
                raise ValueError(
                    f'options["task_index"] must be an int in [0, {len(self.tasks)}), got {index!r}'
                )
            task = self.tasks[index]
        self.task, self.task_index = task, index
        self.turn, self.tool_calls_used, self._done = 0, 0, False
        opening = self.prompt_messages(task)
        self.messages = [dict(m) for m in opening]
        info: dict[str, Any] = {"task_id": task.id, "task_index": index, "family": task.family}
        if self.native_tools:
            info["tools"] = self.native_tools
        try:
            for tool in self.tools.values():
                tool.open()
        except ToolInfraError as exc:
            # Not fatal: the first call retries. The trainer sees the flag if it keeps failing.
            info["infra_error"] = str(exc)
        return [dict(m) for m in opening], info

    def step(self, action: str) -> tuple[list[Message], SupportsFloat, bool, bool, dict[str, Any]]:
        """Run one assistant turn. Example, code format, task "Compute 6 * 7.":

        >>> env.step("```python\\nprint(6 * 7)\\n```")  # doctest: +SKIP
        ([{'role': 'tool', 'name': 'python', 'tool_call_id': '000100000', 'content': '```output\\n42\\n```'}], ...)
        >>> env.step("\\\\boxed{42}")  # doctest: +SKIP
        ([], 1.0, True, False, {'verification': {'correct': True, ...}, ...})
        """
        if self.task is None or self._done:
            raise ResetNeeded("the episode is over (or never started): call env.reset() before env.step()")
        if not isinstance(action, str):
            raise TypeError(f"the action is the assistant's text (str), got {type(action).__name__}")
        self.turn += 1
        self.messages.append({"role": "assistant", "content": action})
        info: dict[str, Any] = {
            "turn": self.turn,
            "task_id": self.task.id,
            "tool_calls": [],
            "parse_errors": [],
        }

        if self.tools:
            parsed = self.format.parse(action)
        else:
            parsed = ParsedTurn(answer=extract_final_answer(action))
        if self.answer_tool is not None and parsed.answer is None:
            parsed = self._answer_by_call(parsed)
        info["parse_errors"] = parsed.errors
        reward = self.turn_reward(parsed, info)

        if parsed.answer is not None or not parsed.items:
            if parsed.items:
                info["skipped_calls"] = len(parsed.items)
            reward += self.outcome_reward(parsed.answer, info)
            return self._end([], reward, terminated=True, info=info)
        if self.turn >= self.max_turns:
            return self._truncate("max_turns", reward, info)
        if self.tool_calls_used >= self.max_tool_calls:
            return self._truncate("tool_budget", reward, info)

        obs: list[Message] = []
        for n, item in enumerate(parsed.items):
            if item.error is not None:
                text = item.error
            elif n >= self.max_calls_per_turn:
                text = f"Error: at most {self.max_calls_per_turn} tool calls per turn; this call was not run."
            elif self.tool_calls_used >= self.max_tool_calls:
                text = "Error: the tool-call budget is used up; give your final answer."
            else:
                try:
                    text = self._run_call(item.call, info)
                except ToolInfraError as exc:
                    info["infra_error"] = str(exc)
                    info["truncated_reason"] = "infra_error"
                    return self._end([], 0.0, terminated=False, info=info)
            obs.append(self._result_message(item, text, n))
        self.messages.extend(dict(m) for m in obs)
        return obs, float(reward), False, False, info

    def render(self) -> str | None:
        if self.render_mode != "ansi":
            return None
        return "\n".join(f"[{m['role']}] {m['content']}" for m in self.messages)

    def close(self) -> None:
        self._close_tools()
        super().close()

    # ----- rewards (override for per-step shaping) ----------------------------------------
    def turn_reward(self, parsed: ParsedTurn, info: dict[str, Any]) -> float:
        """Reward for the turn itself, paid every step. Default: the malformed-call penalty."""
        return -self.reward_config.malformed_call_penalty if parsed.errors else 0.0

    def outcome_reward(self, answer: str | None, info: dict[str, Any]) -> float:
        """Verify the final answer; records `verification` (and `infra_error` if the verifier failed)."""
        assert self.task is not None
        if answer is None:
            verdict = Verification(False, "none")
        else:
            try:
                verdict = self.verifier(answer, self.task.answer)
            except Exception as exc:  # a verifier bug must not look like a wrong answer
                verdict = Verification(False, "error", error=f"verifier raised {type(exc).__name__}: {exc}")
        info["verification"] = {
            "predicted": answer,
            "expected": self.task.answer,
            "correct": verdict.correct,
            "method": verdict.method,
            "error": verdict.error,
        }
        if verdict.error is not None:
            info["verifier_error"] = verdict.error
            info["infra_error"] = f"verifier: {verdict.error}"
        cfg = self.reward_config
        if verdict.correct:
            return cfg.correct
        return cfg.wrong - (cfg.no_answer_penalty if answer is None else 0.0)

    # ----- internals ------------------------------------------------------------------------
    def _answer_by_call(self, parsed: ParsedTurn) -> ParsedTurn:
        """The turn's first call of `answer_tool` as its final answer (the other calls are then
        skipped, as after a boxed answer)."""
        for item in parsed.items:
            if item.call is not None and item.call.name == self.answer_tool:
                value = next(iter(item.call.arguments.values()), None)
                rest = [other for other in parsed.items if other is not item]
                return ParsedTurn(items=rest, answer=None if value is None else str(value))
        return parsed

    def _result_message(self, item: ParsedItem, text: str, n: int) -> Message:
        """Call `n` of this turn's result as a message. Like an OpenAI-style tool message it names
        the tool (`name`: the called one; for a call that could not be parsed the env's only tool,
        else "invalid_tool_call") and carries a `tool_call_id`, since some chat templates require
        them (Mistral's wants 9 alphanumerics): the turn (4 digits) and the call's index (5 digits).
        The assistant's text stays as sampled, so the id refers to the call's place, not to a field."""
        if item.call is not None:
            name = item.call.name
        else:
            name = next(iter(self.tools)) if len(self.tools) == 1 else INVALID_CALL_NAME
        return {
            "role": self.observation_role,
            "name": name,
            "tool_call_id": f"{self.turn % 10_000:04d}{n % 100_000:05d}",
            "content": self.format.render_result(text),
        }

    def _run_call(self, call: Any, info: dict[str, Any]) -> str:
        tool = self.tools.get(call.name)
        record: dict[str, Any] = {"name": call.name, "arguments": call.arguments}
        info["tool_calls"].append(record)
        if tool is None:
            record["ok"] = False
            record["error_type"] = "UnknownTool"
            return f"Error: unknown tool {call.name!r}; available tools: {', '.join(self.tools)}."
        output = tool.call(call.arguments)  # raises ToolInfraError only for infra failures
        self.tool_calls_used += 1
        text = truncate_output(output.text, self.max_output_chars)
        record.update(output.metadata)
        record["ok"] = output.ok
        record["output_chars"] = len(output.text)
        record["output_truncated"] = len(text) != len(output.text)
        return text

    def _truncate(self, reason: str, reward: float, info: dict[str, Any]) -> tuple:
        info["truncated_reason"] = reason
        reward += self.outcome_reward(None, info)
        return self._end([], reward, terminated=False, info=info)

    def _end(self, obs: list[Message], reward: float, *, terminated: bool, info: dict[str, Any]) -> tuple:
        self._done = True
        info["turns"] = self.turn
        info["tool_calls_used"] = self.tool_calls_used
        self._close_tools()
        return obs, float(reward), terminated, not terminated, info

    def _close_tools(self) -> None:
        for tool in self.tools.values():
            tool.close()
