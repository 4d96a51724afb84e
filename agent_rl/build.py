"""Config -> parts: the one place that decides how a `Config` becomes a model, a tokenizer, a sandbox,
an env factory, an engine, collector configs and task splits.

Why one place: the in-process trainer, Ray rollout workers and learner ranks, `agent-rl eval` and
`agent-rl experiment` all build the same parts. When each built them itself, a setting added on one
path was silently missing on another (`rollout.vllm_gpu_memory_utilization` and `model.cpu_threads`
never reached Ray rollout workers). This module imports nothing of `train`, `distributed` or the
commands, so every one of them can import it without a cycle. Heavy imports stay inside functions:
`import agent_rl.build` is cheap.
"""

from __future__ import annotations

import functools
import os
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from agent_rl.config import Config, ConfigError, SandboxConfig
from agent_rl.rollout.collector import CollectorConfig
from agent_rl.rollout.engine import Engine, SamplingParams


def cache_dir() -> Path:
    """Where built tiny models live; AGENT_RL_CACHE moves it (CI, read-only homes)."""
    return Path(os.environ.get("AGENT_RL_CACHE", Path.home() / ".cache" / "agent-rl"))


def resolve_model_path(cfg: Config) -> Path:
    """The configured model folder, or the offline tiny model built once into the cache."""
    if cfg.model.path:
        return Path(cfg.model.path)
    from agent_rl.tiny_model import TinyModelSpec, ensure_tiny_model

    spec = TinyModelSpec(
        hidden_size=cfg.model.tiny_hidden_size,
        num_layers=cfg.model.tiny_layers,
        num_heads=cfg.model.tiny_heads,
        intermediate_size=2 * cfg.model.tiny_hidden_size,
    )
    name = f"tiny-h{spec.hidden_size}-l{spec.num_layers}-a{spec.num_heads}-v{spec.tokenizer_version}"
    return ensure_tiny_model(cache_dir() / "models" / name, spec)


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer of a model folder, with a pad token (collate and the warm-up pad with it)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model_and_tokenizer(
    path: str | Path, dtype: str = "float32", device: str = "cpu"
) -> tuple[Any, Any]:
    """Any causal LM folder (the tiny model or a hub snapshot), loaded the same way everywhere."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device)
    return model, load_tokenizer(path)


def load_policy(cfg: Config, path: str | Path) -> tuple[Any, Any]:
    """The policy the trainer updates: the model at `path`, with LoRA adapters when cfg asks for them."""
    model, tokenizer = load_model_and_tokenizer(path, cfg.model.dtype, cfg.model.device)
    if cfg.model.lora.rank:
        from agent_rl.lora import apply_lora

        model = apply_lora(model, cfg.model.lora)
    return model, tokenizer


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def set_cpu_threads(threads: int | None) -> None:
    """torch intra-op threads for this process; None leaves torch's default."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def uses_gpu(cfg: Config) -> bool:
    """Whether the policy (trainer, HF engine, vLLM engine alike) runs on a GPU: one rule for every path."""
    return cfg.model.device.startswith("cuda")


def max_model_len(cfg: Config) -> int:
    """The engine's context: a whole episode plus one more turn's worth of new tokens."""
    return cfg.rollout.max_total_tokens + cfg.rollout.max_new_tokens


def make_sandbox(cfg: SandboxConfig) -> Any:
    """The sandbox backend named in the config; the env's tool opens one session per episode on it."""
    if cfg.backend == "local":
        from sandbox import LocalSandbox

        return LocalSandbox()
    if cfg.backend == "http":
        from sandbox import Client

        return Client(cfg.url, token=os.environ.get(cfg.token_env), session_wait_s=cfg.session_wait_s)
    from sandbox import DockerSandbox

    return DockerSandbox()


def env_kwargs(cfg: Config) -> dict[str, Any]:
    """`env.kwargs`, with the rollout's turn budget as the env's own unless the config set one, and
    `tool_listing="native"` when `model.tool_schemas` resolves to native for the model's template."""
    kwargs = dict(cfg.env.kwargs)
    kwargs.setdefault("max_turns", cfg.rollout.max_turns)
    if tool_schemas(cfg) == "native":
        kwargs.setdefault("tool_listing", "native")
    return kwargs


def tool_schemas(cfg: Config) -> str:
    """`model.tool_schemas` resolved against the model's chat template: 'native' or 'system_prompt'.
    One answer for every path (trainer, Ray workers, eval, warm-up) since all make envs here."""
    from agent_rl.rollout.chat_delta import ChatTemplateError, resolve_tool_schemas

    if cfg.model.tool_schemas == "system_prompt":
        return "system_prompt"
    try:
        return resolve_tool_schemas(cfg.model.tool_schemas, _renders_tools(cfg.model.path))
    except ChatTemplateError as exc:
        raise ConfigError(str(exc)) from exc


@functools.lru_cache(maxsize=8)
def _renders_tools(model_path: str | None) -> bool:
    """Whether the chat template of the model at `model_path` (None: the offline tiny model's
    ChatML template, which has no tool block) renders `tools=`; read once per process."""
    from agent_rl.rollout.chat_delta import template_renders_tools

    if model_path is None:
        return False
    try:
        tokenizer = load_tokenizer(model_path)
    except OSError:
        # No readable tokenizer there: the model's own loading says so clearly, later; the config
        # and split checks that run before it must not fail on this probe first.
        return False
    return template_renders_tools(tokenizer)


def env_factory(cfg: Config, sandbox: Any) -> Callable[[], Any]:
    """A callable that makes one fresh env per episode, every one sharing `sandbox` (None: the env's
    default backend, made only when a tool first needs it)."""
    import gymnasium

    import envs  # noqa: F401  (registers the agent_rl/ environments)

    env_id, kwargs = cfg.env.id, env_kwargs(cfg)
    if sandbox is not None:
        kwargs["sandbox"] = sandbox

    def make_env() -> Any:
        return gymnasium.make(env_id, **kwargs)

    return make_env


def make_engine(
    cfg: Config,
    model_path: str | Path,
    *,
    model: Any = None,
    tokenizer: Any = None,
    extra: Mapping[str, Any] | None = None,
) -> Engine:
    """The rollout engine of `cfg.rollout.engine`.

    hf: samples with `model` itself (the trainer passes its policy module, so weight sync is free
    and sampling exactly on-policy; a Ray worker passes its own copy). vllm: loads `model_path`;
    `extra` adds VLLMEngine arguments the config does not cover (e.g. tensor_parallel_size).
    """
    if cfg.rollout.engine == "hf":
        if model is None or tokenizer is None:
            raise ValueError("the hf engine samples with a loaded model: pass model= and tokenizer=")
        from agent_rl.rollout.hf_engine import HFEngine

        return HFEngine(
            model, tokenizer, max_model_len=max_model_len(cfg), seed=cfg.train.seed, kv_reuse=cfg.rollout.kv_reuse
        )
    from agent_rl.rollout.vllm_engine import VLLMEngine

    options: dict[str, Any] = {
        "max_model_len": max_model_len(cfg),
        "seed": cfg.train.seed,
        "dtype": cfg.model.dtype,
        "enable_prefix_caching": cfg.rollout.kv_reuse,
    }
    if uses_gpu(cfg):
        options["gpu_memory_utilization"] = cfg.rollout.vllm_gpu_memory_utilization
    options.update(extra or {})
    return VLLMEngine(str(model_path), **options)


class CollectorConfigs(NamedTuple):
    train: CollectorConfig
    """Sampling at the configured temperature and top-p."""
    eval: CollectorConfig
    """Greedy (temperature 0, top-p 1), same budgets: held-out success is deterministic."""


def collector_configs(cfg: Config) -> CollectorConfigs:
    rollout = cfg.rollout
    sampling = SamplingParams(
        temperature=rollout.temperature, top_p=rollout.top_p, max_new_tokens=rollout.max_new_tokens
    )
    budgets = {
        "max_turns": rollout.max_turns,
        "max_total_tokens": rollout.max_total_tokens,
        "max_tool_tokens": rollout.max_tool_tokens,
        "deterministic": rollout.deterministic_batching,
        "chat_delta": cfg.model.chat_delta,
        "chat_template_kwargs": dict(cfg.model.chat_template_kwargs),
    }
    return CollectorConfigs(
        train=CollectorConfig(sampling=sampling, **budgets),
        eval=CollectorConfig(sampling=sampling.with_(temperature=0.0, top_p=1.0), **budgets),
    )


@dataclass(frozen=True)
class TaskSplits:
    """The env's task splits (index ranges of its task source) and the reset options that pick them."""

    env_id: str
    ranges: Mapping[str, range]

    def indices(self, name: str, n: int, *, first: int = 0, wrap: bool = False) -> list[int]:
        """Task indices first..first+n-1 of split `name`; `wrap` cycles through a small split (training
        reads a dataset epoch after epoch), otherwise the split must hold them all."""
        span = self.require(name, 1 if wrap else first + n)
        if wrap:
            return [span[(first + i) % len(span)] for i in range(n)]
        return list(span[first : first + n])

    def reset_options(self, name: str, n: int, *, first: int = 0, wrap: bool = False) -> list[dict[str, int]]:
        """Reset options for those tasks (the task index doubles as the reset seed)."""
        return [{"task_index": i, "seed": i} for i in self.indices(name, n, first=first, wrap=wrap)]

    def require(self, name: str, n: int) -> range:
        """The split, or a ConfigError saying which splits exist, raised before any rollout starts."""
        span = self.ranges.get(name)
        if span is None:
            raise ConfigError(
                f"env {self.env_id!r} has no {name!r} task split (its task source has: "
                f"{', '.join(self.ranges) or 'none'}). {_SPLIT_HINTS.get(name, '')}".rstrip()
            )
        if len(span) < n:
            raise ConfigError(
                f"env {self.env_id!r}: the {name!r} split has {len(span)} tasks, {n} are needed. "
                f"{_SPLIT_HINTS.get(name, '')}".rstrip()
            )
        return span


_SPLIT_HINTS = {
    "eval": "Give held-out tasks (env.kwargs.eval_dataset=...), or set env.eval_tasks=0 / eval --tasks N.",
    "demo": "Warm-up demonstrations need tasks with a solution program (generated tasks); "
    "set train.warmup.steps=0 (or fewer train.warmup.demos).",
}


def task_splits(cfg: Config, make_env: Callable[[], Any] | None = None) -> TaskSplits:
    """Read the splits from one env's task source (the env is closed again; no episode is played)."""
    from envs.tasks import task_splits as source_splits

    env = (make_env or env_factory(cfg, None))()
    try:
        tasks = getattr(env.unwrapped, "tasks", None)
        if tasks is None:
            raise ConfigError(
                f"env {cfg.env.id!r} has no task source (`env.unwrapped.tasks`) to draw tasks from"
            )
        return TaskSplits(cfg.env.id, source_splits(tasks))
    finally:
        env.close()


def check_splits(cfg: Config, splits: TaskSplits, *, warmup: bool) -> None:
    """Fail before any rollout when a split the run will read does not exist or is too small."""
    splits.require("train", 1)
    if cfg.env.eval_tasks:
        splits.require("eval", cfg.env.eval_tasks)
    if warmup and cfg.train.warmup.steps:
        splits.require("demo", cfg.train.warmup.demos + cfg.train.warmup.check_demos)
