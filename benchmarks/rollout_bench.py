"""Benchmark: the rollout collector against the raw engine, for HFEngine and VLLMEngine on CPU.

What it measures (medians over repeats; the machine is shared, so read ratios, not absolutes):
1. Collector wall time for B tasks x N samples x T turns of a multi-turn env.
2. The raw engine's generate time for the same work in the same run: the trajectories are replayed
   turn by turn in lock-step, every sequence of a turn in ONE engine.generate call, with the
   collector's own per-turn seeds (so the same tokens are sampled; the match rate is printed).
   This is the floor a hand-written loop without envs would reach.
3. overhead = collector wall / raw generate time - 1 (target <= 5% with the local sandbox): what
   the env steps, sandbox calls, chat-delta tokenisation and async batching cost on top of
   generation once overlap is accounted for.
4. env share: fraction of the collector's wall time during which at least one env/sandbox call
   was running (high share + low overhead = the overlap works).
5. Policy tokens per second through the collector and through the raw engine.
6. What reproducibility costs: each scenario runs with the collector's default lock-step batching
   (`lockstep/K`: a batch waits for every live episode of one of K fixed cohorts, served in
   rotation, so its composition never depends on timing and one seed gives bit-identical runs;
   --cohorts 1 2 compares K = 1, all episodes in every batch, with the default K = 2, where the
   engine generates one cohort's turn while the other's tools run) and with batching by arrival
   (`arrival`: `rollout.deterministic_batching=false`, throughput first). The ratio lines compare them.
7. Where the overhead goes, as fractions of the raw generate time: `idle` (the engine waited: env
   steps, batching, bookkeeping; what overlap can hide), `work` (extra engine-thread CPU time, e.g.
   smaller batches), `desched` (the engine thread was runnable but off the CPU: sandbox processes
   and other jobs on the cores, or this process's other threads holding the GIL; no overlap hides
   it). The engine thread's CPU time is time.thread_time() around each generate call, in the
   collector and in the replay alike.
   Every collect and every replay starts from the same state: the engine's kept KV released, a gc
   pass, and (with the sandbox) a full worker pool after 1 s of quiet, as after a learner step
   (--back-to-back: no wait; see BenchConfig.back_to_back). The per-repeat ratios are printed too.

8. With --turn-cost: what one turn costs as the episode grows (issue "Long horizons"). B episodes
   play T turns in lock-step straight on the engine; every turn feeds the same number of new
   tokens (turn 1: a prompt of --tool-tokens ids; later turns: a tool reply of as many ids) and
   samples --turn-tokens more. Printed: seconds per turn at turn 1 and turn T, and their ratio,
   with KV reuse (hf: per-episode caches; vllm: prefix caching) and without (re-prefill). Target:
   turn T <= 1.5x turn 1 with reuse.

Envs: "scripted" replies instantly; "sandbox" runs one real cell per turn in a LocalSandbox
session (bubblewrap when installed), the default sandbox of our environments.

Run:  python benchmarks/rollout_bench.py [--engines hf vllm] [--envs scripted sandbox]
      [--tasks 8 --group-size 4 --turns 3 --max-new-tokens 32 --repeats 3] [--pin] [--stop-fraction 0.05]
      [--back-to-back]
      --pin: the trainer's process on CPU 0, every sandbox process on CPU 1 (fair CPU accounting on a
      2-core box: see pin_thread); --stop-fraction: turns of varying length (see BenchConfig).
      python benchmarks/rollout_bench.py --turn-cost [--engines hf vllm --tasks 8 --turns 16
      --tool-tokens 32 --turn-tokens 32 --repeats 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import gymnasium
import torch

from agent_rl.rollout.collector import Collector, CollectorConfig, turn_seed
from agent_rl.rollout.engine import SamplingParams
from agent_rl.rollout.trajectory import Trajectory


@dataclass(frozen=True)
class BenchConfig:
    engines: tuple[str, ...] = ("hf", "vllm")
    envs: tuple[str, ...] = ("scripted", "sandbox")
    tasks: int = 8
    """B: distinct tasks per collect() call."""
    group_size: int = 4
    """N: samples per task."""
    turns: int = 3
    """Policy turns per episode (the env terminates after this many)."""
    max_new_tokens: int = 32
    """Per turn."""
    repeats: int = 3
    threads: int = 1
    """torch intra-op threads; 1 avoids oversubscription on the shared 2-core machines."""
    model_dir: str | None = None
    """A model directory; None builds the bench model below into .cache/bench/."""
    hidden: int = 256
    """Bench model size: the test model (hidden 64) decodes so fast that any env dominates, unlike
    real models; hidden 256 x 4 layers keeps the generate/env ratio closer to practice on CPU."""
    layers: int = 4
    kv_heads: int | None = None
    """Key/value heads of the bench model; None = as many as query heads (MHA). Real models share
    them (Qwen2.5-0.5B: 14 query, 2 KV heads), which makes attention over a long context 4-7x cheaper
    relative to the rest of a decode step; --turn-cost reports depend on it."""
    batch_wait_s: float = CollectorConfig.batch_wait_s
    batching: tuple[str, ...] = ("deterministic", "arrival")
    cohorts: tuple[int, ...] = (CollectorConfig.cohorts,)
    """CollectorConfig.cohorts values to run with deterministic batching (one row each)."""
    stop_fraction: float = 0.0
    """Fraction of the vocabulary that ends a turn (stop_token_ids). 0: every turn runs to
    max_new_tokens, the bench model's habit; real turns end when the model closes its tool call,
    at lengths that vary, so 0.05 (about 1 in 20 sampled tokens stops) is closer to practice."""
    back_to_back: bool = False
    """Start each collect at once, while the sandbox pool still replaces the workers of the last
    collect's closed sessions (32 worker starts, ~0.8 s of CPU on the sandbox's core). False: each
    collect (and its raw replay) starts from a full pool, as in training, where the pool refills
    while the learner updates the policy. Back to back, the repeats alternate between a full and
    a refilling pool (the measured collect follows another collect every other repeat)."""


# ---------------------------------------------------------------- envs


class ScriptedEnv(gymnasium.Env):
    """A multi-turn env with an instant, fixed-size tool reply."""

    def __init__(self, turns: int) -> None:
        self.turns = turns
        self.turn = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.turn = 0
        return [
            {"role": "system", "content": "Use python."},
            {"role": "user", "content": f"What is {seed} * 7?"},
        ], {}

    def _tool_output(self, action: str) -> str:
        return f"```output\n{len(action) * 7}\n```"

    def step(self, action: str):
        self.turn += 1
        done = self.turn >= self.turns
        obs = [] if done else [{"role": "tool", "content": self._tool_output(action)}]
        return obs, float(done), done, False, {}


class SandboxEnv(ScriptedEnv):
    """Runs one cell per turn in a LocalSandbox session (as our Python tool does)."""

    def __init__(self, turns: int, sandbox: Any) -> None:
        super().__init__(turns)
        self.sandbox = sandbox
        self.session: Any = None

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        if self.session is None:
            self.session = self.sandbox.session()
        return super().reset(seed=seed, options=options)

    def _tool_output(self, action: str) -> str:
        result = self.session.run(f"x = {len(action)}\nprint(sum(i * i for i in range(x)))", timeout_s=5)
        return f"```output\n{result.stdout.strip()}\n```"

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None


# ---------------------------------------------------------------- measurement


def turn_starts(traj: Trajectory) -> list[int]:
    """Response offsets where each policy turn begins."""
    starts, previous = [], 0
    for i, m in enumerate(traj.response_mask):
        if m and not previous:
            starts.append(i)
        previous = m
    return starts


class EngineClock:
    """Wraps engine.generate to sum its wall time and the calling thread's CPU time.

    Why the thread's CPU time: wall minus CPU is the time the engine thread was runnable but not
    running (other processes on the cores, or the GIL), which separates CPU contention from the
    engine doing more work. An engine that computes in other threads or processes (vLLM's
    workers) shows a low CPU/wall ratio in both the collector and the replay; compare the two.
    It also counts the thread's minor page faults: memory the allocator handed back to the OS
    and faulted in again, zero-filled (agent_rl.rollout.cpu_heap), is engine work the replay
    may not do.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.inner = engine.generate
        self.wall = 0.0
        self.cpu = 0.0
        self.faults = 0
        self.calls = 0
        engine.generate = self.generate

    def generate(self, prompts: Any, params: Any) -> Any:
        faults = _thread_faults()
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return self.inner(prompts, params)
        finally:
            self.cpu += time.thread_time() - cpu
            self.wall += time.perf_counter() - wall
            self.faults += _thread_faults() - faults
            self.calls += 1

    def take(self) -> tuple[float, float, float]:
        """(wall, cpu, minor faults per call) since the last take."""
        out = (self.wall, self.cpu, self.faults / max(self.calls, 1))
        self.wall = self.cpu = 0.0
        self.faults = self.calls = 0
        return out

    def restore(self) -> None:
        self.engine.generate = self.inner


def _thread_faults() -> int:
    """Minor page faults of the calling thread so far (0 where RUSAGE_THREAD is missing)."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    return 0 if who is None else resource.getrusage(who).ru_minflt


def replay(
    engine: Any, trajs: list[Trajectory], sampling: SamplingParams, call_seed: int
) -> tuple[float, float]:
    """Regenerate every turn in lock-step batches; return (seconds, fraction of turns reproduced)."""
    per_turn: dict[int, list[tuple[list[int], SamplingParams, list[int]]]] = {}
    for t in trajs:
        starts = turn_starts(t)
        for k, start in enumerate(starts):
            end = start + t.turns[k].policy_tokens
            prefix = t.prompt_ids + t.response_ids[:start]
            params = sampling.with_(seed=turn_seed(call_seed, t.group_id, t.sample_index, k))
            per_turn.setdefault(k, []).append((prefix, params, t.response_ids[start:end]))
    seconds, same, total = 0.0, 0, 0
    for k in sorted(per_turn):
        batch = per_turn[k]
        started = time.perf_counter()
        outs = engine.generate([b[0] for b in batch], [b[1] for b in batch])
        seconds += time.perf_counter() - started
        same += sum(o.token_ids == b[2] for o, b in zip(outs, batch, strict=True))
        total += len(batch)
    return seconds, same / max(total, 1)


@dataclass
class Row:
    engine: str
    env: str
    batching: str
    wall: list[float] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)
    raw: list[float] = field(default_factory=list)
    env_share: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    batch: list[float] = field(default_factory=list)
    match: list[float] = field(default_factory=list)
    bookkeeping: list[float] = field(default_factory=list)
    busy_cpu: list[float] = field(default_factory=list)
    """Engine-thread CPU seconds inside the collector's engine calls."""
    raw_cpu: list[float] = field(default_factory=list)
    """Engine-thread CPU seconds inside the replay's engine calls."""
    faults: list[float] = field(default_factory=list)
    """Engine-thread minor page faults per engine call in the collector."""
    raw_faults: list[float] = field(default_factory=list)
    """The same per call of the replay."""


def model_dir(cfg: BenchConfig) -> str:
    if cfg.model_dir is not None:
        return cfg.model_dir
    from agent_rl.tiny_model import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(
        hidden_size=cfg.hidden,
        num_layers=cfg.layers,
        num_heads=cfg.hidden // 64,
        intermediate_size=4 * cfg.hidden,
        max_position_embeddings=8192,  # long-horizon episodes (--turn-cost)
    )
    kv = f"-kv{cfg.kv_heads}" if cfg.kv_heads else ""
    out = Path(".cache/bench") / f"tiny-h{cfg.hidden}-l{cfg.layers}{kv}"
    marker = out / "tiny_model_spec.json"
    if not marker.exists() or json.loads(marker.read_text()) != asdict(spec):
        build_tiny_model(out, spec)
        if cfg.kv_heads:
            share_kv_heads(out, cfg.kv_heads)
    return str(out)


def share_kv_heads(path: Path, kv_heads: int) -> None:
    """Rebuild the saved bench model with grouped-query attention (same seed, fewer KV heads)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    if config.num_attention_heads % kv_heads:
        raise ValueError(f"--kv-heads {kv_heads} must divide the {config.num_attention_heads} query heads")
    config.num_key_value_heads = kv_heads
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)


def make_engine(name: str, cfg: BenchConfig, path: str) -> Any:
    max_len = 64 + cfg.turns * (cfg.max_new_tokens + 48) + 64
    if name == "hf":
        from agent_rl.rollout.hf_engine import HFEngine

        return HFEngine.from_pretrained(path, dtype="float32", max_model_len=max_len)
    from agent_rl.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(
        path,
        dtype="float32",
        max_model_len=max_len,
        max_num_seqs=cfg.tasks * cfg.group_size,
        kv_cache_memory_bytes=128 * 2**20,
    )


def stop_ids(tokenizer: Any, fraction: float) -> list[int]:
    """The first `fraction` of the vocabulary's ordinary ids (no special token), as stop ids."""
    special = set(tokenizer.all_special_ids)
    ordinary = [i for i in range(len(tokenizer)) if i not in special]
    return ordinary[: round(fraction * len(ordinary))]


def run_scenario(
    engine: Any, engine_name: str, env_name: str, batching: str, cfg: BenchConfig, sandbox: Any
) -> Row:
    """`batching`: 'lockstep/K' (deterministic, K cohorts) or 'arrival'."""
    clock = EngineClock(engine)
    try:
        return measure(engine, engine_name, env_name, batching, cfg, sandbox, clock)
    finally:
        clock.restore()


def measure(
    engine: Any,
    engine_name: str,
    env_name: str,
    batching: str,
    cfg: BenchConfig,
    sandbox: Any,
    clock: EngineClock,
) -> Row:
    def factory() -> gymnasium.Env:
        return ScriptedEnv(cfg.turns) if env_name == "scripted" else SandboxEnv(cfg.turns, sandbox)

    sampling = SamplingParams(
        temperature=1.0,
        max_new_tokens=cfg.max_new_tokens,
        stop_token_ids=stop_ids(engine.tokenizer, cfg.stop_fraction),
    )
    config = CollectorConfig(
        sampling=sampling,
        max_turns=cfg.turns,
        max_total_tokens=engine.max_model_len,
        max_tool_tokens=64,
        env_workers=cfg.tasks * cfg.group_size,
        batch_wait_s=cfg.batch_wait_s,
        deterministic=batching.startswith("lockstep"),
        cohorts=int(batching.split("/")[1]) if batching.startswith("lockstep") else 1,
    )
    collector = Collector(engine, engine.tokenizer, factory, config)

    def settle() -> None:
        release = getattr(engine, "release_cache", None)
        if callable(release):
            release()
        gc.collect()

    def collect(seed: int) -> list[Trajectory]:
        if sandbox is not None and not cfg.back_to_back:
            sandbox.pool.wait_ready(timeout_s=120)  # see BenchConfig.back_to_back
            time.sleep(1.0)
        settle()
        return collector.collect(tasks, cfg.group_size, seed=seed)

    tasks = list(range(cfg.tasks))
    collect(10_000)  # warm-up: compile, sandbox pool, caches
    clock.take()
    row = Row(engine_name, env_name, batching)
    for r in range(cfg.repeats):
        # Alternate which of the pair runs first, so load drifts on the shared machine cancel out.
        if r % 2:
            reference = collect(r)
            clock.take()
            settle()
            raw_s, match = replay(engine, reference, sampling, call_seed=r)
            _, raw_cpu, raw_faults = clock.take()
        trajs = collect(r)
        _, busy_cpu, faults = clock.take()
        stats = collector.last_stats
        bad = [t.infra_error for t in trajs if t.infra_error]
        if bad:
            raise RuntimeError(
                f"{engine_name}/{env_name}: infrastructure errors during the benchmark: {bad[:3]}"
            )
        if not r % 2:
            settle()
            raw_s, match = replay(engine, trajs, sampling, call_seed=r)
            _, raw_cpu, raw_faults = clock.take()
        row.busy_cpu.append(busy_cpu)
        row.raw_cpu.append(raw_cpu)
        row.faults.append(faults)
        row.raw_faults.append(raw_faults)
        row.wall.append(stats.wall_s)
        row.busy.append(stats.engine_busy_s)
        row.raw.append(raw_s)
        row.env_share.append(stats.env_busy_s / stats.wall_s)
        row.tokens.append(stats.policy_tokens)
        row.batch.append(stats.sequences_generated / max(stats.engine_calls, 1))
        row.match.append(match)
        row.bookkeeping.append(stats.bookkeeping_s)
    return row


def print_table(rows: list[Row], cfg: BenchConfig) -> None:
    med = statistics.median
    print(
        f"\nrollout benchmark: B={cfg.tasks} x N={cfg.group_size}, {cfg.turns} turns, <= {cfg.max_new_tokens} new "
        f"tokens/turn (stop fraction {cfg.stop_fraction}), {cfg.repeats} repeats (medians), torch threads "
        f"{cfg.threads}, model {cfg.model_dir or 'bench'} "
        f"(hidden {cfg.hidden}, {cfg.layers} layers)"
    )
    columns = [
        ("engine", "<6"), ("env", "<9"), ("batching", "<16"), ("policy tok", ">10"), ("collector s", ">11"), ("raw gen s", ">9"),
        ("overhead", ">8"), ("best/best", ">9"), ("bookkeeping", ">11"), ("engine idle", ">11"),
        ("gen slowdown", ">12"), ("env share", ">9"), ("tok/s coll", ">10"), ("tok/s raw", ">9"),
        ("mean batch", ">10"), ("replay match", ">12"),
    ]  # fmt: skip
    header = " ".join(f"{name:{spec}}" for name, spec in columns)
    print(header)
    print("-" * len(header))
    for r in rows:
        wall, raw, tokens = med(r.wall), med(r.raw), med(r.tokens)
        values = [
            r.engine,
            r.env,
            r.batching,
            f"{tokens:.0f}",
            f"{wall:.3f}",
            f"{raw:.3f}",
            f"{_overhead(r):+.1%}",
            f"{min(r.wall) / min(r.raw) - 1:+.1%}",
            f"{med([k / b for k, b in zip(r.bookkeeping, r.busy, strict=True)]):.1%}",
            f"{med([1 - b / w for b, w in zip(r.busy, r.wall, strict=True)]):.1%}",
            f"{med([b / x - 1 for b, x in zip(r.busy, r.raw, strict=True)]):+.1%}",
            f"{med(r.env_share):.1%}",
            f"{tokens / wall:.0f}",
            f"{tokens / raw:.0f}",
            f"{med(r.batch):.1f}",
            f"{med(r.match):.0%}",
        ]
        print(" ".join(f"{v:{spec}}" for v, (_, spec) in zip(values, columns, strict=True)))
    print(
        "\noverhead = collector wall / raw lock-step generate time (same tokens, same run) - 1, median of per-repeat\n"
        "  ratios; best/best = fastest collector run / fastest raw run - 1. Target <= +5% with the sandbox.\n"
        "bookkeeping = the collector's own token work (chat deltas, decoding, checks) / engine time.\n"
        "engine idle = wall-time fraction the engine waited (on envs, batching or bookkeeping).\n"
        "gen slowdown = engine-call time inside the collector / the same calls replayed raw - 1: CPU contention\n"
        "  from env/sandbox processes on a 2-core machine shows here, not as engine idle.\n"
        "env share = wall-time fraction with >= 1 env/sandbox call running."
    )
    pool = "back to back (pool refilling)" if cfg.back_to_back else "each collect from a full sandbox pool"
    print(f"\nper-repeat overhead ({pool}):")
    for r in rows:
        per = " ".join(f"{w / x - 1:+.1%}" for w, x in zip(r.wall, r.raw, strict=True))
        print(f"  {r.engine}/{r.env}/{r.batching}: {per}")
    print_split(rows)
    by_key = {(r.engine, r.env, r.batching): r for r in rows}
    for (engine, env, batching), r in by_key.items():
        other = by_key.get((engine, env, "arrival"))
        if batching != "arrival" and other is not None:
            print(
                f"reproducibility cost {engine}/{env}: {batching} / arrival collector wall = "
                f"{med(r.wall) / med(other.wall):.2f}x (tokens/s {med(r.tokens) / med(r.wall):.0f} vs "
                f"{med(other.tokens) / med(other.wall):.0f})"
            )
        one = by_key.get((engine, env, "lockstep/1"))
        if batching.startswith("lockstep/") and batching != "lockstep/1" and one is not None:
            print(
                f"cohorts {engine}/{env}: {batching} / lockstep/1 collector wall = {med(r.wall) / med(one.wall):.2f}x, "
                f"overhead {_overhead(r):+.1%} vs {_overhead(one):+.1%}"
            )


def _overhead(r: Row) -> float:
    """Median over repeats of collector wall / raw generate time - 1."""
    return statistics.median(w / x - 1 for w, x in zip(r.wall, r.raw, strict=True))


def print_split(rows: list[Row]) -> None:
    """Overhead = idle + work + desched, each as a fraction of the raw generate time (medians of
    per-repeat values, so the parts need not add up exactly to the median overhead)."""
    med = statistics.median
    print(
        f"\n{'engine':<6} {'env':<9} {'batching':<16} {'overhead':>8} {'idle':>7} {'work':>7} {'desched':>8} "
        f"{'cpu/wall coll':>13} {'cpu/wall raw':>12} {'faults/call coll':>16} {'raw':>7}"
    )
    for r in rows:
        parts = list(zip(r.wall, r.busy, r.busy_cpu, r.raw, r.raw_cpu, strict=True))
        idle = med((w - b) / x for w, b, _, x, _ in parts)
        work = med((bc - xc) / x for _, _, bc, x, xc in parts)
        desched = med(((b - bc) - (x - xc)) / x for _, b, bc, x, xc in parts)
        print(
            f"{r.engine:<6} {r.env:<9} {r.batching:<16} {med((w - x) / x for w, _, _, x, _ in parts):>+8.1%} "
            f"{idle:>+7.1%} {work:>+7.1%} {desched:>+8.1%} {med(bc / b for _, b, bc, _, _ in parts):>13.2f} "
            f"{med(xc / x for *_, x, xc in parts):>12.2f} {med(r.faults):>16.0f} {med(r.raw_faults):>7.0f}"
        )
    print(
        "idle = engine waiting (env steps, batching, bookkeeping; what overlap can hide); work = extra engine-thread\n"
        "  CPU time (e.g. smaller batches); desched = extra time the engine thread was runnable but off the CPU\n"
        "  (sandbox processes, other jobs, the GIL: contention no overlap hides). All / raw generate time.\n"
        "faults/call = the engine thread's minor page faults per engine call (memory faulted in afresh)."
    )


# ---------------------------------------------------------------- per-turn cost (--turn-cost)


@dataclass
class TurnCost:
    engine: str
    reuse: bool
    seconds: list[list[float]] = field(default_factory=list)
    """Per repeat, per turn: the generate() call's wall time."""
    new_tokens: list[list[int]] = field(default_factory=list)
    """Per repeat, per turn: prompt tokens fed for the first time plus tokens sampled."""
    context: list[int] = field(default_factory=list)
    """Per turn: mean prompt length (first repeat)."""


def play_turns(
    engine: Any, cfg: BenchConfig, tool_tokens: int, turn_tokens: int, seed: int
) -> tuple[list[float], list[int], list[int]]:
    """One lock-step game of cfg.turns turns for cfg.tasks episodes; per-turn seconds, new tokens, context."""
    import random

    rng = random.Random(seed)
    vocab = min(len(engine.tokenizer), 250)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    history = [ids(tool_tokens) for _ in range(cfg.tasks)]
    seconds, new_tokens, context = [], [], []
    for turn in range(cfg.turns):
        params = [
            SamplingParams(temperature=1.0, max_new_tokens=turn_tokens, seed=turn_seed(seed, i, turn))
            for i in range(cfg.tasks)
        ]
        started = time.perf_counter()
        outs = engine.generate(history, params)
        seconds.append(time.perf_counter() - started)
        new_tokens.append(sum(len(o.token_ids) for o in outs) + cfg.tasks * tool_tokens)
        context.append(sum(len(h) for h in history) // len(history))
        history = [h + o.token_ids + ids(tool_tokens) for h, o in zip(history, outs, strict=True)]
    return seconds, new_tokens, context


def make_turn_engine(name: str, reuse: bool, cfg: BenchConfig, path: str, max_len: int) -> Any:
    if name == "hf":
        from agent_rl.rollout.hf_engine import HFEngine

        return HFEngine.from_pretrained(path, dtype="float32", max_model_len=max_len, kv_reuse=reuse)
    from agent_rl.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(
        path,
        dtype="float32",
        max_model_len=max_len,
        max_num_seqs=cfg.tasks,
        kv_cache_memory_bytes=256 * 2**20,
        enable_prefix_caching=reuse,
    )


def run_turn_cost(cfg: BenchConfig, path: str, tool_tokens: int, turn_tokens: int) -> list[TurnCost]:
    max_len = cfg.turns * (tool_tokens + turn_tokens) + 64
    rows = []
    for name in cfg.engines:
        for reuse in (True, False):
            engine = make_turn_engine(name, reuse, cfg, path, max_len)
            play_turns(engine, cfg, tool_tokens, turn_tokens, seed=10_000)  # warm-up (compile, allocator)
            row = TurnCost(name, reuse)
            for r in range(cfg.repeats):
                seconds, new, context = play_turns(engine, cfg, tool_tokens, turn_tokens, seed=r)
                row.seconds.append(seconds)
                row.new_tokens.append(new)
                row.context = row.context or context
            rows.append(row)
            print(f"done: turn cost {name} reuse={reuse}", file=sys.stderr)
            del engine
    return rows


def print_turn_cost(rows: list[TurnCost], cfg: BenchConfig, tool_tokens: int, turn_tokens: int) -> None:
    med = statistics.median
    last = cfg.turns - 1
    print(
        f"\nper-turn cost: {cfg.tasks} episodes x {cfg.turns} turns in lock-step, {tool_tokens} new prompt/tool ids + "
        f"<= {turn_tokens} sampled per turn, {cfg.repeats} repeats (medians), torch threads {cfg.threads}, model "
        f"{cfg.model_dir or 'bench'} (hidden {cfg.hidden}, {cfg.layers} layers, {cfg.kv_heads or cfg.hidden // 64} KV heads)"
    )
    header = f"{'engine':<6} {'kv reuse':<9} {'context T':>9} {'turn 1 s':>9} {f'turn {cfg.turns} s':>10} {'T / 1':>7} {'T / 1 per new tok':>18} {'all turns s':>11}"
    print(header)
    print("-" * len(header))
    for r in rows:
        first, final = med(s[0] for s in r.seconds), med(s[last] for s in r.seconds)
        per_tok = med(
            (s[last] / n[last]) / (s[0] / n[0]) for s, n in zip(r.seconds, r.new_tokens, strict=True)
        )
        total = med(sum(s) for s in r.seconds)
        print(
            f"{r.engine:<6} {'on' if r.reuse else 'off':<9} {r.context[last]:>9} {first:>9.3f} {final:>10.3f} "
            f"{final / first:>6.2f}x {per_tok:>17.2f}x {total:>11.2f}"
        )
    print(
        f"T / 1 = seconds of turn {cfg.turns} / seconds of turn 1 (target <= 1.5x with reuse); per new tok divides each by\n"
        "  the tokens it fed for the first time + sampled (an eos can end a turn early). context T = mean prompt length."
    )


def pin_thread(cpu: int) -> None:
    """Pin the calling thread (and the threads and processes it starts from now on) to one CPU.

    Why --pin: on this 2-core box the sandbox's processes otherwise take the engine's core, which
    shows as engine time (desched), not as collector overhead a GPU node would have. Pinned, the
    trainer's process (engine and collector threads) runs on CPU 0 and every sandbox process on
    CPU 1, as a GPU engine's sandbox runs on cores of its own: what is left is the collector's own
    cost (waiting on tools, batching, bookkeeping) and its threads' share of the engine's core and
    GIL. (Tried: the engine thread alone on CPU 0, collector and sandbox on CPU 1: the tools then
    share a core with the collector's threads and the engine waits longer, +12% against +6%.)
    """
    if not hasattr(os, "sched_setaffinity") or cpu >= (os.cpu_count() or 1):
        raise SystemExit(f"--pin needs Linux and at least 2 CPUs (has {os.cpu_count()})")
    os.sched_setaffinity(0, {cpu})  # pid 0: the calling thread only


def modes(cfg: BenchConfig) -> list[str]:
    """The batching rows to run: 'lockstep/K' per cohort count (deterministic), then 'arrival'."""
    out = [f"lockstep/{k}" for k in cfg.cohorts] if "deterministic" in cfg.batching else []
    return out + (["arrival"] if "arrival" in cfg.batching else [])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", nargs="+", default=list(BenchConfig.engines), choices=["hf", "vllm"])
    p.add_argument("--envs", nargs="+", default=list(BenchConfig.envs), choices=["scripted", "sandbox"])
    p.add_argument("--tasks", type=int, default=BenchConfig.tasks)
    p.add_argument("--group-size", type=int, default=BenchConfig.group_size)
    p.add_argument("--turns", type=int, default=BenchConfig.turns)
    p.add_argument("--max-new-tokens", type=int, default=BenchConfig.max_new_tokens)
    p.add_argument("--repeats", type=int, default=BenchConfig.repeats)
    p.add_argument("--threads", type=int, default=BenchConfig.threads)
    p.add_argument("--model-dir", default=None, help="a model dir (default: build the bench model)")
    p.add_argument("--hidden", type=int, default=BenchConfig.hidden)
    p.add_argument("--layers", type=int, default=BenchConfig.layers)
    p.add_argument("--kv-heads", type=int, default=None, help="bench model KV heads (default: MHA)")
    p.add_argument("--batch-wait", type=float, default=BenchConfig.batch_wait_s)
    p.add_argument(
        "--batching", nargs="+", default=list(BenchConfig.batching), choices=["deterministic", "arrival"]
    )
    p.add_argument(
        "--cohorts",
        nargs="+",
        type=int,
        default=list(BenchConfig.cohorts),
        help="deterministic: cohorts to run",
    )
    p.add_argument("--stop-fraction", type=float, default=BenchConfig.stop_fraction, help="see BenchConfig")
    p.add_argument(
        "--pin",
        action="store_true",
        help="engine and collector on CPU 0, sandbox workers on CPU 1 (as a GPU node keeps them apart)",
    )
    p.add_argument(
        "--back-to-back",
        action="store_true",
        help="collects do not wait for a full sandbox pool (see BenchConfig)",
    )
    p.add_argument("--turn-cost", action="store_true", help="measure per-turn cost vs turn index instead")
    p.add_argument("--tool-tokens", type=int, default=32, help="--turn-cost: new prompt/tool ids per turn")
    p.add_argument("--turn-tokens", type=int, default=32, help="--turn-cost: sampled tokens per turn")
    args = p.parse_args(argv)
    cfg = BenchConfig(
        engines=tuple(args.engines),
        envs=tuple(args.envs),
        tasks=args.tasks,
        group_size=args.group_size,
        turns=args.turns,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        threads=args.threads,
        model_dir=args.model_dir,
        hidden=args.hidden,
        layers=args.layers,
        kv_heads=args.kv_heads,
        batch_wait_s=args.batch_wait,
        batching=tuple(args.batching),
        cohorts=tuple(args.cohorts),
        stop_fraction=args.stop_fraction,
        back_to_back=args.back_to_back,
    )
    path = model_dir(cfg)
    torch.set_num_threads(cfg.threads)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep the table readable
    if args.turn_cost:
        rows = run_turn_cost(cfg, path, args.tool_tokens, args.turn_tokens)
        print_turn_cost(rows, cfg, args.tool_tokens, args.turn_tokens)
        return 0
    sandbox = None
    if args.pin:
        pin_thread(1)  # the sandbox's workers and its pool's threads inherit CPU 1 from here
    if "sandbox" in cfg.envs:
        from sandbox import LocalSandbox

        # One warm worker per concurrent episode, as a deployment sized for its batch would have.
        sandbox = LocalSandbox(pool_size=cfg.tasks * cfg.group_size)
    if args.pin:
        pin_thread(0)  # this thread (the engine's) and the collector's threads made from it
    print(
        f"CPU affinity: {'engine + collector on CPU 0, sandbox on CPU 1' if args.pin else 'none (shared cores)'}"
    )
    rows = []
    try:
        for engine_name in cfg.engines:
            engine = make_engine(engine_name, cfg, path)
            for env_name in cfg.envs:
                for batching in modes(cfg):
                    rows.append(run_scenario(engine, engine_name, env_name, batching, cfg, sandbox))
                    print(f"done: {engine_name}/{env_name}/{batching}", file=sys.stderr)
    finally:
        if sandbox is not None:
            sandbox.close()
    print_table(rows, cfg)
    if sandbox is not None:
        p = sandbox.pool
        print(
            f"sandbox pool over the run: {p.booted} workers booted ahead of demand, {p.cold_starts} "
            f"started for a waiting session, {p.recycled} came back after a session"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
