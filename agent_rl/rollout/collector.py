"""Runs B tasks x N samples of a Gymnasium env concurrently and returns token-exact trajectories.

How it overlaps work: each episode is a coroutine. Env construction, reset and step (which may
call a sandbox) run in a thread pool; generation runs in one engine thread. By default batches
are formed in lock-step (every live episode waits for the batch), so no batch's composition
depends on timing and runs stay reproducible; with `CollectorConfig.cohorts` > 1 the lock-step
batches are per fixed cohort of episodes, served in rotation, so the engine generates one
cohort's turn while another cohort's tool calls run. With `deterministic=False`,
whenever the engine is free one call batches every sequence that is waiting for a turn.

Token bookkeeping per turn (the invariants `Trajectory.check` asserts after every append):
  1. the ids the policy sampled are appended verbatim, mask 1, with their sampling log-probs;
  2. the env is stepped with their decoded text;
  3. the env's reply is appended as the chat-template delta (agent_rl.rollout.chat_delta), mask 0,
     log-prob 0. The history is never re-tokenised.
The step reward is added on that turn's last policy token, so the outcome reward sits on the
last policy token of the episode.

Budgets (max turns, max total tokens, max tool tokens) end or cut episodes and always record
why in `stop_reason` / `TurnRecord.tool_truncated_tokens`. Exceptions from the env and
`info["infra_error"]` end the episode with `infra_error` set: the sample is kept for logging but
the learner excludes it (`agent_rl.batch.RolloutBatch.valid`). Engine errors are not the episode's
fault and propagate to the caller.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from agent_rl.rollout.chat_delta import (
    DEFAULT_REFERENCE,
    ChatDelta,
    ChatTemplateError,
    template_renders_tools,
)
from agent_rl.rollout.decode import decode_turn, marker_ids
from agent_rl.rollout.engine import Completion, Engine, SamplingParams
from agent_rl.rollout.trajectory import Trajectory, TurnRecord, json_safe

log = logging.getLogger(__name__)

ResetArgs = int | Mapping[str, Any]
"""What one episode is reset with: an int is a reset seed; a mapping is passed as reset options, its
'seed' key (if any) as the seed. (Not `envs.tasks.Task`, the problem the env picks from these.)"""


@dataclass
class CollectorConfig:
    """Budgets and sampling for one collect() call."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Per-turn sampling; `max_new_tokens` caps each turn, `seed` is ignored (see `seed`)."""
    max_turns: int = 4
    """Policy turns per episode; reaching it without termination gives stop_reason 'max_turns'."""
    max_total_tokens: int = 512
    """Prompt + response tokens per episode; a turn is shortened or the episode ends
    ('max_total_tokens') rather than exceed it."""
    max_tool_tokens: int = 64
    """Content tokens kept from each env reply; the rest is cut with a visible marker."""
    seed: int = 0
    """Base of the per-sample, per-turn engine seeds; collect(seed=...) overrides per call."""
    env_workers: int = 32
    """Threads for env construction, reset, step and close (sandbox calls block in them)."""
    max_batch_size: int | None = None
    """Most sequences per engine call (None = all waiting ones)."""
    deterministic: bool = True
    """Batch in lockstep: every engine call waits until each live episode is waiting for a turn
    (or finished), and serves them in a fixed order. A batch's composition is then a function of
    the episodes' state, never of thread or sandbox timing, so one seed gives the same tokens,
    log-probs and metrics in every process (batched float arithmetic depends on who shares the
    batch). The cost is that the engine waits for the slowest tool call of a turn; False batches
    by arrival with the adaptive wait below (throughput first, reproducible only up to float noise)."""
    cohorts: int = 1
    """With deterministic=True: the episodes of a collect() are split into this many cohorts by
    index (contiguous blocks, never by timing), and the engine serves the cohorts' lock-step
    batches in strict rotation, so it generates one cohort's turn while another's env steps (tool
    calls) run. Each batch's rows, and the order of the engine calls, still depend only on the
    episodes' state, so one seed still gives the same tokens in every process; another `cohorts`
    gives other batches, hence log-probs equal only up to float rounding. Default 1 (every live
    episode in each batch): on the 2-core CPU bench the engine idled only 2-3% of the wall time
    waiting for the sandbox, while 2 cohorts (half-size batches) cost the HF engine +20% CPU work
    (benchmarks/rollout_bench.py --cohorts 1 2). Try 2 where a call's time barely grows with the
    batch (a GPU) and tool calls are slow."""
    lockstep_stall_s: float = 10.0
    """With deterministic=True: if no episode arrives or finishes for this long, some episode is
    waiting on something other than the engine (e.g. a sandbox slot held by an episode that is
    itself waiting for the batch), and lock-step would deadlock; the rest of this collect() then
    batches by arrival, and `perf/lockstep_stalls` counts it."""
    batch_wait_s: float | None = None
    """With deterministic=False: how long a generation call may wait for episodes still in an env
    step to join it. None = adaptive: a quarter of the recent engine-call time (50 ms before the
    first call), since a split batch costs about one more engine call while waiting costs only the
    wait. 0 = never wait."""
    batch_wait_fraction: float = 0.25
    """The adaptive wait as a fraction of the recent engine-call duration (with batch_wait_s=None)."""
    chat_template: str | None = None
    """Override of the tokenizer's chat template (None = the tokenizer's own)."""
    chat_delta: str = "auto"
    """How env replies become tokens (agent_rl.rollout.chat_delta): 'auto', 'append' or 'anchor'.
    'auto' handles templates that are not append-only (Qwen3's think block)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra chat-template variables for every render, e.g. {"enable_thinking": False} (Qwen3)."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.max_tool_tokens < 0:
            raise ValueError(f"max_tool_tokens must be >= 0, got {self.max_tool_tokens}")
        if self.max_total_tokens < 2:
            raise ValueError(f"max_total_tokens must be >= 2, got {self.max_total_tokens}")
        if self.env_workers < 1:
            raise ValueError(f"env_workers must be >= 1, got {self.env_workers}")
        if self.cohorts < 1:
            raise ValueError(f"cohorts must be >= 1, got {self.cohorts}")
        if self.batch_wait_s is not None and self.batch_wait_s < 0:
            raise ValueError(f"batch_wait_s must be >= 0 or None (adaptive), got {self.batch_wait_s}")


@dataclass
class CollectStats:
    """Where the wall time of the last collect() went (metrics under the `perf/` prefix)."""

    wall_s: float = 0.0
    engine_busy_s: float = 0.0
    """Sum of engine.generate durations (the engine runs one call at a time)."""
    engine_calls: int = 0
    sequences_generated: int = 0
    policy_tokens: int = 0
    env_s: float = 0.0
    """Sum over episodes of time inside env calls (overlapping episodes add up)."""
    env_busy_s: float = 0.0
    """Wall time during which at least one env call ran."""
    lockstep_stalls: int = 0
    """collect() calls whose lock-step batching stalled and fell back to arrival order."""
    bookkeeping_s: float = 0.0
    """Time in the collector's own token work: prompts, chat deltas, decoding, checks."""

    def finish(self, wall_s: float, env_busy_s: float, trajectories: Sequence[Trajectory]) -> None:
        """Close the books of one collect()."""
        self.wall_s, self.env_busy_s = wall_s, env_busy_s
        self.env_s = sum(t.timings.get("env", 0.0) for t in trajectories)
        self.policy_tokens = sum(t.num_policy_tokens for t in trajectories)

    def as_metrics(self) -> dict[str, float]:
        calls = max(self.engine_calls, 1)
        return {
            "perf/rollout_wall_s": self.wall_s,
            "perf/engine_busy_s": self.engine_busy_s,
            "perf/engine_idle_frac": 1.0 - self.engine_busy_s / self.wall_s if self.wall_s else 0.0,
            "perf/engine_mean_batch": self.sequences_generated / calls,
            "perf/policy_tokens_per_s": self.policy_tokens / self.wall_s if self.wall_s else 0.0,
            "perf/env_busy_frac": self.env_busy_s / self.wall_s if self.wall_s else 0.0,
            "perf/bookkeeping_s": self.bookkeeping_s,
            "perf/lockstep_stalls": self.lockstep_stalls,
        }


def turn_seed(*parts: int) -> int:
    """The engine seed of one turn: turn_seed(call_seed, group, sample, turn).

    Deterministic, so an episode can be replayed token for token (engines sample batch-invariantly
    per seed); mixed, because neighbouring samples must not get correlated streams.
    """
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h ^= (p & 0xFFFFFFFFFFFFFFFF) + 0x9E3779B97F4A7C15 + ((h << 6) & 0xFFFFFFFFFFFFFFFF) + (h >> 2)
        h &= 0xFFFFFFFFFFFFFFFF
    return h % (2**31 - 1)


@dataclass
class _Request:
    """One episode's request for its next turn, tagged with the episode's cohort."""

    prompt: list[int]
    params: SamplingParams
    cohort: int
    future: asyncio.Future[Completion]

    def order(self) -> tuple[int, list[int]]:
        """The timing-free order rows take inside a lock-step batch: (seed, prompt). Seeds are per
        (call, group, sample, turn), and rows that tie on both are identical anyway."""
        return (-1 if self.params.seed is None else self.params.seed, self.prompt)


def cohort_of(index: int, episodes: int, cohorts: int) -> int:
    """The cohort of episode `index` (0..episodes-1): contiguous blocks of near-equal size, so a
    group's samples share a cohort (and a batch) whenever the groups divide evenly. A function of
    the index only, never of timing, which is what keeps lock-step batches reproducible."""
    return index * min(cohorts, max(episodes, 1)) // max(episodes, 1)


class _Batcher:
    """Collects generation requests from episodes and serves them in batched engine calls.

    Lock-step (deterministic) batching serves the cohorts in strict rotation: cohort c's batch is
    formed once every live episode of c waits for a turn, then cohort c+1's, and so on. While
    one cohort's env steps run, the engine generates another's turn, and the sequence of engine
    calls (their rows and their order) is still a function of the episodes' state alone.
    """

    def __init__(
        self,
        engine: Engine,
        config: CollectorConfig,
        stats: CollectStats,
        sizes: list[int],
        thread: ThreadPoolExecutor,
    ) -> None:
        self.engine = engine
        self.config = config
        self.stats = stats
        self._live = list(sizes)
        """Episodes per cohort that have not finished."""
        self._pending: list[_Request] = []
        self._next_cohort = 0
        self._wake = asyncio.Event()
        self._thread = thread
        self._recent_call_s: float | None = None
        self._stalled = False

    def _wait_budget(self) -> float:
        if self.config.batch_wait_s is not None:
            return self.config.batch_wait_s
        if self._recent_call_s is None:
            return 0.05
        return self.config.batch_wait_fraction * self._recent_call_s

    async def generate(self, prompt: list[int], params: SamplingParams, cohort: int = 0) -> Completion:
        future: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        self._pending.append(_Request(prompt, params, cohort, future))
        self._wake.set()
        return await future

    def finished(self, cohort: int) -> None:
        """An episode of `cohort` ended: a batch waiting for it may be complete now."""
        self._live[cohort] -= 1
        self._wake.set()

    async def _wait_wake(self, timeout: float | None) -> bool:
        """Wait for an arrival or a finished episode; False when `timeout` passed first.

        Not `asyncio.wait_for`: on Python 3.11 it swallows a cancellation that arrives just as the
        event fires (the last episode ends as collect() cancels this server), and the server would
        then wait forever; `asyncio.wait` lets the cancellation through."""
        self._wake.clear()
        waiter = asyncio.ensure_future(self._wake.wait())
        try:
            done, _ = await asyncio.wait({waiter}, timeout=timeout)
        finally:
            waiter.cancel()
        return bool(done)

    async def _lockstep_batch(self) -> list[_Request] | None:
        """The next cohort's batch in rotation, once each of its live episodes waits for a turn;
        None after a stall (lock-step is then off for the rest of this collect)."""
        while True:
            if not any(self._live):
                await self._wait_wake(None)
                continue
            cohort = self._next_cohort
            if self._live[cohort] == 0:  # every episode of it ended: its slot in the rotation goes
                self._next_cohort = (cohort + 1) % len(self._live)
                continue
            batch = [r for r in self._pending if r.cohort == cohort]
            if len(batch) >= self._live[cohort]:
                self._next_cohort = (cohort + 1) % len(self._live)
                self._pending = [r for r in self._pending if r.cohort != cohort]
                return sorted(batch, key=_Request.order)
            if not await self._wait_wake(self.config.lockstep_stall_s):
                self._stall(len(batch), self._live[cohort])
                return None

    def _stall(self, waiting: int, live: int) -> None:
        self._stalled = True
        self.stats.lockstep_stalls += 1
        log.warning(
            "lock-step batching stalled for %.0f s (%d of %d episodes of a cohort waiting for the "
            "engine); batching by arrival for the rest of this collect",
            self.config.lockstep_stall_s,
            waiting,
            live,
        )

    async def _arrival_batch(self, loop: asyncio.AbstractEventLoop) -> list[_Request]:
        """Whoever waits now, after a short wait for episodes still in an env step to join."""
        while not self._pending:
            await self._wait_wake(None)
        deadline = loop.time() + self._wait_budget()
        while len(self._pending) < sum(self._live) and loop.time() < deadline:
            await asyncio.sleep(0.0005)
        limit = self.config.max_batch_size or len(self._pending)
        batch, self._pending = self._pending[:limit], self._pending[limit:]
        return batch

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = None
            if self.config.deterministic and not self._stalled:
                batch = await self._lockstep_batch()
            if batch is None:
                batch = await self._arrival_batch(loop)
            limit = self.config.max_batch_size or len(batch)
            for first in range(0, len(batch), limit):
                await self._serve(batch[first : first + limit], loop)

    async def _serve(self, batch: list[_Request], loop: asyncio.AbstractEventLoop) -> None:
        """One engine call; its results (or its error) go to the requests' futures."""
        started = time.perf_counter()
        try:
            results = await loop.run_in_executor(
                self._thread, self.engine.generate, [r.prompt for r in batch], [r.params for r in batch]
            )
        except Exception as exc:
            for r in batch:
                if not r.future.done():
                    r.future.set_exception(exc)
            return
        finally:
            took = time.perf_counter() - started
            self.stats.engine_busy_s += took
            previous = self._recent_call_s
            self._recent_call_s = took if previous is None else 0.7 * previous + 0.3 * took
        self.stats.engine_calls += 1
        self.stats.sequences_generated += len(batch)
        for r, result in zip(batch, results, strict=True):
            if not r.future.done():
                r.future.set_result(result)


class _EnvClock:
    """Tracks total and union time of env calls across threads (for the sandbox wall-time share)."""

    def __init__(self) -> None:
        self.active = 0
        self.busy_since = 0.0
        self.busy_s = 0.0

    def enter(self) -> None:
        if self.active == 0:
            self.busy_since = time.perf_counter()
        self.active += 1

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self.busy_s += time.perf_counter() - self.busy_since


def _checked_groups(
    tasks: Sequence[ResetArgs], group_size: int, group_ids: Sequence[int] | None
) -> list[int]:
    """The group id of each task, after rejecting a bad group size, group ids or task (before any
    env is built, so bad input costs nothing)."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    groups = list(range(len(tasks)) if group_ids is None else group_ids)
    if len(groups) != len(tasks):
        raise ValueError(f"{len(tasks)} tasks but {len(groups)} group ids")
    for task in tasks:
        _reset_args(task)
    return groups


class Collector:
    """Collects multi-turn trajectories: `Collector(engine, tokenizer, env_factory, config).collect(tasks, N)`.

    `env_factory` is a Gymnasium id (made with `gymnasium.make(id, **env_kwargs)`) or a callable
    returning a fresh env; one env is made per episode and closed after it.
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        env_factory: str | Callable[[], Any],
        config: CollectorConfig | None = None,
        *,
        env_kwargs: Mapping[str, Any] | None = None,
        reference: Sequence[Mapping[str, str]] = DEFAULT_REFERENCE,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config or CollectorConfig()
        self.reference = [dict(m) for m in reference]
        self.delta = self._chat_delta(None)
        self._tool_deltas: dict[str, ChatDelta] = {}
        if isinstance(env_factory, str):
            import gymnasium

            env_id, kwargs = env_factory, dict(env_kwargs or {})
            self._make_env: Callable[[], Any] = lambda: gymnasium.make(env_id, **kwargs)
        else:
            if env_kwargs:
                raise ValueError("env_kwargs only applies to an env id; bind them into your factory instead")
            self._make_env = env_factory
        self.last_stats = CollectStats()
        self._calls = 0
        self._markers = marker_ids(tokenizer)
        """Tool-call special tokens kept when a turn is decoded for the env (rollout.decode)."""
        self._engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        """Every engine call of every collect() runs on this one thread. Why not a thread per
        collect(): a new thread allocates from another malloc arena, and at the rollout bench's
        sizes its calls took 17-26k page faults each against 0-7k on a thread that had made calls
        before (see agent_rl.rollout.cpu_heap); one thread also keeps calls
        from concurrent collect_async() calls on this collector from running at once."""

    def _chat_delta(self, tools: list[dict[str, Any]] | None) -> ChatDelta:
        return ChatDelta(
            self.tokenizer,
            self.reference,
            chat_template=self.config.chat_template,
            mode=self.config.chat_delta,
            tools=tools,
            template_kwargs=self.config.chat_template_kwargs,
        )

    def delta_for(self, tools: Any) -> ChatDelta:
        """The renderer of an episode whose env listed `tools` natively (reset ``info["tools"]``, see
        envs.ToolEnv's `tool_listing`): every render passes them as `tools=`. None: the env's system
        prompt describes its tools and renders carry none. One renderer per distinct tool list."""
        if not tools:
            return self.delta
        key = json.dumps(tools, sort_keys=True, default=str)
        if key not in self._tool_deltas:
            if not template_renders_tools(self.tokenizer, self.config.chat_template):
                raise ChatTemplateError(
                    "the env left its tool list out of the prompt for the chat template (reset info['tools'], "
                    "tool_listing='native'), but this chat template does not render tools=, so the model "
                    "would never see them; set model.tool_schemas to 'system_prompt' or 'auto'"
                )
            self._tool_deltas[key] = self._chat_delta(list(tools))
        return self._tool_deltas[key]

    # ------------------------------------------------------------------ public API
    def collect(
        self,
        tasks: Sequence[ResetArgs],
        group_size: int,
        *,
        seed: int | None = None,
        group_ids: Sequence[int] | None = None,
        on_episode: Callable[[], None] | None = None,
    ) -> list[Trajectory]:
        """B tasks x `group_size` samples, grouped: trajectories[g * N + s] is sample s of task g.

        `seed` fixes every engine seed of this call (pass the training step for reproducible runs);
        None uses config.seed + the number of earlier calls. `group_ids` numbers the tasks' groups
        (default 0..B-1); a shard of a larger batch passes its groups' numbers in that batch, since
        turn seeds and trajectory ids derive from them. `on_episode` is called as each episode ends
        (progress bars). From inside an event loop, await `collect_async` instead.
        """
        return asyncio.run(
            self.collect_async(tasks, group_size, seed=seed, group_ids=group_ids, on_episode=on_episode)
        )

    async def collect_async(
        self,
        tasks: Sequence[ResetArgs],
        group_size: int,
        *,
        seed: int | None = None,
        group_ids: Sequence[int] | None = None,
        on_episode: Callable[[], None] | None = None,
    ) -> list[Trajectory]:
        groups = _checked_groups(tasks, group_size, group_ids)
        call_seed = self.config.seed + self._calls if seed is None else seed
        self._calls += 1
        stats = CollectStats()
        self.last_stats = stats
        started = time.perf_counter()
        clock = _EnvClock()
        n = len(tasks) * group_size
        cohorts = [cohort_of(i, n, self.config.cohorts) for i in range(n)]
        sizes = [cohorts.count(c) for c in range(max(cohorts, default=0) + 1)]
        batcher = _Batcher(self.engine, self.config, stats, sizes, self._engine_thread)
        pool = ThreadPoolExecutor(max_workers=self.config.env_workers, thread_name_prefix="env")
        server = asyncio.create_task(batcher.run())

        async def one(i: int, g: int, s: int, task: ResetArgs) -> Trajectory:
            try:
                episode = _Episode(
                    self, Trajectory(f"{call_seed}-{g}-{s}", g, s, json_safe(task)), batcher, pool, clock
                )
                episode.cohort = cohorts[i]
                return await episode.play(task, turn_seeds=(call_seed, g, s))
            finally:
                batcher.finished(cohorts[i])  # a batch waiting for this episode may be complete
                if on_episode is not None:
                    on_episode()

        try:
            pairs = enumerate(zip(groups, tasks, strict=True))
            episodes = [
                one(k * group_size + s, g, s, task) for k, (g, task) in pairs for s in range(group_size)
            ]
            # Let every episode finish (and close its env) before an engine error is raised.
            results = await asyncio.gather(*episodes, return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise errors[0]
            trajectories = [r for r in results if isinstance(r, Trajectory)]
        finally:
            server.cancel()
            try:
                await server
            except asyncio.CancelledError:
                pass
            self._engine_thread.submit(lambda: None).result()  # a cancelled call ends before release()
            pool.shutdown(wait=False, cancel_futures=True)
            release = getattr(self.engine, "release_cache", None)
            if callable(release):  # this call's episodes are over: their kept KV can go
                release()
        stats.finish(time.perf_counter() - started, clock.busy_s, trajectories)
        return trajectories

    @staticmethod
    def _append_policy(traj: Trajectory, completion: Completion) -> None:
        n = len(completion.token_ids)
        traj.response_ids.extend(completion.token_ids)
        traj.response_mask.extend([1] * n)
        traj.log_probs.extend(completion.log_probs)
        traj.token_rewards.extend([0.0] * n)
        traj.num_policy_tokens += n
        traj.check(deep=False)  # the batch builder checks every token once

    @staticmethod
    def _append_env(traj: Trajectory, delta: list[int]) -> None:
        n = len(delta)
        traj.response_ids.extend(delta)
        traj.response_mask.extend([0] * n)
        traj.log_probs.extend([0.0] * n)
        traj.token_rewards.extend([0.0] * n)
        traj.num_tool_tokens += n
        traj.check(deep=False)  # the batch builder checks every token once


class _Episode:
    """One episode, read as its loop: open (make + reset + prompt), then per turn a policy turn (sample
    and append), an env turn (step and place the reward) and the env's reply appended as delta tokens.

    Why an object: those steps share the trajectory, the env, the executor and the timers. Failures
    of the env are recorded on the trajectory (`fail`), never raised; engine errors propagate.
    """

    def __init__(
        self,
        collector: Collector,
        traj: Trajectory,
        batcher: _Batcher,
        pool: ThreadPoolExecutor,
        clock: _EnvClock,
    ) -> None:
        self.collector, self.config, self.traj = collector, collector.config, traj
        self.batcher, self.stats, self.pool, self.clock = batcher, batcher.stats, pool, clock
        self.timings = traj.timings = {"generate_wait": 0.0, "env": 0.0, "total": 0.0}
        self.env: Any = None
        self.delta = collector.delta
        """This episode's renderer: with the env's tool schemas when it listed them natively."""
        self.limit = 0
        """Prompt + response tokens this episode may reach (the budget and the engine's context)."""
        self.cohort = 0
        """Which lock-step cohort's batches this episode's turns join (CollectorConfig.cohorts)."""

    async def play(self, task: ResetArgs, turn_seeds: tuple[int, int, int]) -> Trajectory:
        started = time.perf_counter()
        try:
            if await self.open(task):
                await self.turns(turn_seeds)
        finally:
            await self.close()
            self.timings["total"] = time.perf_counter() - started
        return self.traj

    async def turns(self, turn_seeds: tuple[int, int, int]) -> None:
        """Policy turn, env turn, reply, until a stop rule ends the episode (the reason is recorded)."""
        traj, cfg = self.traj, self.config
        for turn in range(cfg.max_turns):
            room = self.limit - len(traj.prompt_ids) - len(traj.response_ids)
            if room <= 0:
                traj.stop_reason = "max_total_tokens"
                return
            completion, record, text = await self.policy_turn(room, turn_seed(*turn_seeds, turn))
            reply = await self.env_turn(text, record, last_turn=turn == cfg.max_turns - 1)
            if reply is None or not self.append_reply(reply, completion, record):
                return

    async def in_env(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run an env call in the env threads, timed (per episode, and the union over episodes)."""
        t0 = time.perf_counter()
        self.clock.enter()
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, lambda: fn(*args, **kwargs))
        finally:
            self.clock.leave()
            self.timings["env"] += time.perf_counter() - t0

    def fail(self, where: str, error: BaseException | str) -> None:
        detail = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self.traj.infra_error = f"{where}: {detail}"
        self.traj.stop_reason = "infra_error"
        log.warning("episode %s: infrastructure failure in %s: %s", self.traj.traj_id, where, detail)

    async def open(self, task: ResetArgs) -> bool:
        """Make and reset the env, tokenise the prompt; False when that failed (recorded)."""
        try:
            self.env = await self.in_env(self.collector._make_env)
            seed, options = _reset_args(task)
            obs, info = await self.in_env(self.env.reset, seed=seed, options=options)
        except Exception as exc:
            self.fail("env.reset", exc)
            return False
        info = dict(info or {})
        self.traj.reset_info = json_safe(info)
        if info.get("infra_error"):
            self.fail("env.reset", str(info["infra_error"]))
            return False
        t0 = time.perf_counter()
        self.delta = self.collector.delta_for(info.get("tools"))
        self.traj.prompt_ids = self.delta.prompt_ids(obs)
        self.stats.bookkeeping_s += time.perf_counter() - t0
        self.limit = min(self.config.max_total_tokens, self.collector.engine.max_model_len)
        return True

    async def policy_turn(self, room: int, seed: int) -> tuple[Completion, TurnRecord, str]:
        """Sample one turn (at most `room` tokens) and append its ids verbatim, mask 1; returns the
        completion, the turn's record and its decoded text."""
        sampling = self.config.sampling
        params = sampling.with_(max_new_tokens=min(sampling.max_new_tokens, room), seed=seed)
        t0 = time.perf_counter()
        prompt = self.traj.prompt_ids + self.traj.response_ids
        completion = await self.batcher.generate(prompt, params, self.cohort)
        t1 = time.perf_counter()
        self.timings["generate_wait"] += t1 - t0
        Collector._append_policy(self.traj, completion)
        record = TurnRecord(policy_tokens=len(completion.token_ids), finish_reason=completion.finish_reason)
        self.traj.turns.append(record)
        text = decode_turn(self.collector.tokenizer, completion.token_ids, self.collector._markers)
        self.stats.bookkeeping_s += time.perf_counter() - t1
        return completion, record, text

    async def env_turn(self, text: str, record: TurnRecord, *, last_turn: bool) -> list[Any] | None:
        """Step the env with the turn's text and put its reward on the turn's last policy token; the
        env's new messages, or None when the episode ends here (the reason recorded)."""
        traj = self.traj
        try:
            obs, reward, terminated, truncated, info = await self.in_env(self.env.step, text)
        except Exception as exc:
            self.fail("env.step", exc)
            return None
        info = dict(info or {})
        record.reward = float(reward)
        record.info = json_safe(info)
        traj.token_rewards[-1] += record.reward  # the last token appended is this turn's last policy token
        traj.reward += record.reward
        if info.get("infra_error"):
            self.fail("env.step", str(info["infra_error"]))
            return None
        ended = (
            "terminated" if terminated else "env_truncated" if truncated else "max_turns" if last_turn else ""
        )
        if ended:
            traj.stop_reason = ended
            return None
        if not obs:
            self.fail("env.step", "the env returned no new messages but did not end the episode")
            return None
        return list(obs)

    def append_reply(self, messages: list[Any], completion: Completion, record: TurnRecord) -> bool:
        """Append the env's reply as chat-template delta tokens (mask 0), its tool output cut to
        max_tool_tokens; False when the reply plus one more policy token would not fit (the episode
        ends, and the dropped reply is recorded rather than silently lost)."""
        t0 = time.perf_counter()
        delta_maker, traj = self.delta, self.traj
        cut = delta_maker.truncate_tool_messages(messages, self.config.max_tool_tokens)
        record.tool_truncated_tokens = cut.cut_tokens
        ended_with_eos = completion.token_ids[-1] == self.collector.engine.eos_token_id
        delta = delta_maker.delta_ids(cut.messages, ended_with_eos)
        self.stats.bookkeeping_s += time.perf_counter() - t0
        if len(traj.prompt_ids) + len(traj.response_ids) + len(delta) >= self.limit:
            record.info["dropped_reply_tokens"] = len(delta)
            traj.stop_reason = "max_total_tokens"
            return False
        Collector._append_env(traj, delta)
        record.tool_tokens = len(delta)
        return True

    async def close(self) -> None:
        if self.env is None:
            return
        try:
            await self.in_env(self.env.close)
        except Exception as exc:  # a failing close must not lose the episode
            log.warning("episode %s: env.close failed: %s", self.traj.traj_id, exc)


def _reset_args(task: ResetArgs) -> tuple[int | None, dict[str, Any] | None]:
    if isinstance(task, bool) or not isinstance(task, (int, Mapping)):
        raise TypeError(f"a task is an int seed or a mapping of reset options, got {type(task).__name__}")
    if isinstance(task, int):
        return task, None
    options = dict(task)
    seed = options.pop("seed", None)
    return seed, options or None
