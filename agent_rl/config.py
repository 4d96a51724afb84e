"""Typed configuration: YAML files validated into pydantic models, with `--set a.b=c` overrides.

Why pydantic with `extra="forbid"`: a typo in a config key must stop the run before it wastes an
hour of compute, and the error must name the key, the value and what was expected.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key, value and expectation."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraConfig(Section):
    rank: int = Field(0, ge=0)
    """0 trains every weight; r > 0 trains rank-r LoRA adapters on `targets` instead (peft), with the
    base weights frozen. The sampler receives merged weights; checkpoints hold only the adapter."""
    alpha: float = Field(16.0, gt=0)
    """The adapters' scale is alpha / rank."""
    targets: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Names of the linear modules that get adapters (the attention projections of Llama/Qwen)."""


class ModelConfig(Section):
    path: str | None = None
    """A local model directory (tiny or a hub snapshot). None builds the offline tiny model."""
    tiny_hidden_size: int = Field(64, ge=32)
    """Sizes for the offline tiny model when `path` is None."""
    tiny_layers: int = Field(2, ge=1)
    tiny_heads: int = Field(2, ge=1)
    dtype: Literal["float32", "bfloat16"] = "float32"
    device: str = "cpu"
    """'cpu', 'cuda' or 'cuda:N'."""
    cpu_threads: int | None = Field(None, ge=1)
    """torch CPU threads (None = torch's default). On a small shared machine 1 is often fastest:
    measured here, a tiny-model warm-up ran 16x faster with 1 thread than with 2 while sandbox
    workers and other processes competed for the same 2 cores (OpenMP threads spin-wait)."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    chat_delta: Literal["auto", "append", "anchor"] = "auto"
    """How env replies are tokenised after a policy turn (docs/chat_templates.md): 'append' needs an
    append-only template; 'anchor' also handles templates that rewrite earlier turns (Qwen3's think
    block); 'auto' picks per render. Sampled ids are kept verbatim in every mode."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra chat-template variables, e.g. {enable_thinking: false} for Qwen3."""
    tool_schemas: Literal["auto", "native", "system_prompt"] = "auto"
    """Where the env's tool JSON schemas go (docs/chat_templates.md). native: passed as
    `apply_chat_template(tools=...)`, so the model sees its own trained tool block (Qwen2.5/Qwen3
    `<tools>`, Llama 3.1, Mistral), and the env's system prompt drops its "Tools:" line;
    system_prompt: that line lists them, no `tools=`; auto (default): native when the model's chat
    template renders tools, else system_prompt (the offline tiny model's ChatML template). Applies to
    function-calling formats (hermes); the ```python format has no list either way."""


class SandboxConfig(Section):
    backend: Literal["local", "http", "docker"] = "local"
    """local: in-process LocalSandbox (bubblewrap); http: a sandbox service at `url`; docker: one container per session."""
    url: str | None = None
    """Service URL for backend=http, e.g. http://127.0.0.1:8080, or comma-separated replicas
    (the Client round-robins sessions over them; a session stays on its replica)."""
    token_env: str = "AGENT_RL_SANDBOX_TOKEN"
    """Environment variable that holds the bearer token for backend=http."""
    session_wait_s: float = Field(600.0, ge=0)
    """backend=http: how long an episode waits for a free session while the server holds its
    `max_sessions` (answers 429), before the episode fails as an infrastructure error."""

    @model_validator(mode="after")
    def _url_for_http(self) -> SandboxConfig:
        if self.backend == "http" and not self.url:
            raise ValueError(
                "backend 'http' needs sandbox.url (e.g. --set sandbox.url=http://127.0.0.1:8080)"
            )
        return self


class EnvConfig(Section):
    id: str = "agent_rl/PythonMath-v0"
    """A registered Gymnasium id (`ns/Name-vN`)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments passed to `gymnasium.make`."""
    eval_tasks: int = Field(64, ge=0)
    """Held-out tasks scored greedily at the start and end of training (0 = none)."""


class RolloutConfig(Section):
    engine: Literal["hf", "vllm"] = "hf"
    prompts_per_step: int = Field(8, ge=1)
    """B: distinct prompts per training step."""
    group_size: int = Field(4, ge=1)
    """N: samples per prompt; the group over which baselines are formed."""
    max_turns: int = Field(4, ge=1)
    max_new_tokens: int = Field(64, ge=1)
    """Per assistant turn."""
    max_total_tokens: int = Field(512, ge=16)
    """Per trajectory, prompt included."""
    max_tool_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    deterministic_batching: bool = True
    """Lockstep engine batches whose composition never depends on timing, so that one seed gives
    bit-identical runs on one machine (see CollectorConfig.deterministic). False trades that for
    throughput when tool calls are slow and uneven (benchmarks/rollout_bench.py measures both)."""
    kv_reuse: bool = True
    """Reuse earlier turns' KV so a turn pays for its new tokens only: per-episode caches in the hf
    engine (same log-probs as re-prefilling, to float rounding), prefix caching in vllm."""
    vllm_gpu_memory_utilization: float = Field(0.4, gt=0, lt=1)
    """engine=vllm on a GPU: the share of GPU memory vLLM may take beside the trainer (ignored on CPU)."""
    async_steps: int = Field(0, ge=0, le=1)
    """0 = synchronous: collect, then update, on the same weights (exactly on-policy; the default).
    1 = one-step-off-policy pipelining (docs/async.md): step t+1's rollouts are collected, from a
    frozen copy of the weights, while step t updates, so a step costs about max(rollout, update)
    instead of their sum; samples are then one policy version old, and algo.is_correction 'auto'
    becomes 'token' to correct for it. The in-process hf engine then samples with a second copy of
    the model (2x the weights' memory)."""
    max_staleness: int = Field(1, ge=0)
    """Most policy versions a sample may lag the learner; older ones are dropped before the update
    (metric async/dropped_stale). Must be >= async_steps."""


class AlgoConfig(Section):
    estimator: str = "tir_otb"
    """Advantage estimator by registry name: otb, tir_otb, grpo, rloo, opo, reinforce, exact_optimal."""
    estimator_options: dict[str, Any] = Field(default_factory=dict)
    clip_eps: float = Field(0.2, gt=0)
    """PPO clip range epsilon (the lower one, and the upper one unless clip_eps_high is set)."""
    clip_eps_high: float | None = Field(None, gt=0)
    """DAPO's clip-higher: the ratio is clipped to [1 - clip_eps, 1 + clip_eps_high], so unlikely
    tokens with A > 0 can grow further (DAPO uses 0.28 with clip_eps 0.2). None = clip_eps (symmetric)."""
    is_correction: Literal["auto", "off", "token", "geometric", "sequence"] = "auto"
    """Off-policy correction between sampler and trainer log-probs (docs/offpolicy.md): token =
    w_t = min(rho_t, is_cap) with rho_t = p_trainer / p_sampler; geometric / sequence = the same,
    and sequences whose geometric-mean / product ratio leaves is_band get weight 0. auto = off with
    rollout.engine hf (the sampler is the trainer's own model), token with vllm; resolved when the
    config is validated. The weights scale each token's PPO term and, squared, OTB's proxy."""
    is_cap: float = Field(2.0, ge=1)
    """C: truncation level of the per-token importance ratio."""
    is_band: tuple[float, float] | None = None
    """[lo, hi] for the sequence modes; None = [0.99, 1.01] (geometric) or [0.5, 2.0] (sequence)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop groups whose valid members all got the same reward (no signal
    under a group baseline) and collect more prompts until prompts_per_step informative groups
    are found or dynamic_sampling_max_rounds collections were made (then the step trains on what
    it has). Off = every group is kept (today's behaviour)."""
    dynamic_sampling_max_rounds: int = Field(3, ge=1)
    """Cap on collections per step with dynamic_sampling (the first one included)."""
    overlong: Literal["keep", "filter", "penalty"] = "keep"
    """Episodes cut by a budget (max_turns, max_total_tokens, the env's limit): keep = train on them
    as they are; filter = their tokens get no loss term (they still count in the group's baseline);
    penalty = overlong_penalty is subtracted from their reward (DAPO's soft overlong punishment,
    with a linear ramp over the last overlong_buffer tokens of rollout.max_total_tokens)."""
    overlong_penalty: float = Field(1.0, ge=0)
    """Reward subtracted from a truncated episode (and the ramp's full value) with overlong=penalty."""
    overlong_buffer: int = Field(0, ge=0)
    """Tokens before rollout.max_total_tokens over which the penalty ramps 0 -> overlong_penalty,
    whether or not the episode was cut (0 = no ramp, only truncated episodes are penalised)."""
    overlong_max_tokens: int | None = Field(None, ge=1)
    """The length budget the ramp ends at; None = rollout.max_total_tokens (filled in on validation)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 (None disables)."""
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL penalty to the initial (reference) policy; 0 skips the reference model."""
    entropy_coef: float = Field(0.0, ge=0)
    ppo_epochs: int = Field(1, ge=1)
    minibatches: int = Field(1, ge=1)
    """Optimiser steps per rollout batch (per epoch)."""
    micro_batch_size: int = Field(16, ge=1)
    """Sequences per forward/backward; gradients accumulate over a minibatch."""
    pack_tokens: int | None = Field(None, ge=1)
    """Sequence packing (agent_rl/packing.py, docs/learner_memory.md): the rows of each micro-batch
    are laid end to end in packed rows of at most this many tokens (first-fit-decreasing; a longer
    row gets a packed row alone), each with its own positions and a block-diagonal causal mask,
    instead of all being padded to the longest row. Same gradients up to float rounding. None =
    off (default for now: the quickstart's learning curve is sensitive to that rounding)."""

    @field_validator("is_correction", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        """YAML reads a bare `off` as False; it means the mode 'off'."""
        return "off" if value is False else value

    @model_validator(mode="after")
    def _is_band_brackets_one(self) -> AlgoConfig:
        band = self.is_band
        if band is not None and not (0.0 <= band[0] < 1.0 < band[1]):
            raise ValueError(
                f"is_band must be [lo, hi] with 0 <= lo < 1 < hi (e.g. [0.5, 2.0]); got {list(band)}"
            )
        return self


class WarmupConfig(Section):
    steps: int = Field(0, ge=0)
    """Supervised steps on scripted tool-use demonstrations before RL (0 = none)."""
    batch_size: int = Field(16, ge=1)
    lr: float = Field(3e-3, gt=0)
    lr_schedule: Literal["constant", "linear"] = "linear"
    """linear: decay to 0 at the last step, so the warmed-up model does not depend on the last
    few noisy steps (see agent_rl.warmup.run_warmup)."""
    hallucinate_fraction: float = Field(0.0, ge=0, lt=1)
    """Share of demonstrations that make the tool's output up instead of waiting for it
    (envs.demos.hallucinated_demonstration). Deliberately imperfect teaching: above 0.5 the
    warmed-up greedy policy never waits for the tool (success ~0), and RL must discover that
    waiting pays. Every demonstration still copies an output into the box, so that skill is
    trained on all of them."""
    demos: int = Field(1024, ge=1)
    """Distinct demonstrations played through the env (too few and a small model memorises them)."""
    check_demos: int = Field(0, ge=0)
    """After the warm-up, this many held-out correct demonstrations (the demo split after the
    training ones) check that the model reproduces their turns greedily, token for token, each
    given the demonstration's history: `eval/final_turn_accuracy` (the answer turn) and
    `eval/turn_accuracy` (every assistant turn) in metrics.jsonl and summary.json. 0 = no check."""
    clean_steps: int = Field(0, ge=0)
    """The first k updates draw only the correct demonstrations; the flawed ones are mixed in after.
    Why: a skill the correct ones teach (copying the tool's output into the answer) is learned in a
    sudden transition that the flawed ones can block. Measured on the quickstart (seed 0, Intel
    AVX-512 kernels): mixed from the start, the loss settled at 0.20 in a basin where the model never
    copies (greedy copy accuracy 0/40, and RL never found a success); with 300 clean updates first,
    40/40 on both kernel paths. The quickstart uses 700 (half), because in one seed the transition
    came only after update 300 (scripts/quickstart_matrix.py shows the copy check per cell)."""
    clean_shortest: float = Field(1.0, gt=0, le=1)
    """The clean updates draw only this share of the correct demonstrations, the shortest first (a
    length curriculum). Why: the copy transition comes sooner in short contexts. Measured on the
    long-horizon chain (configs/long_horizon.yaml, depth 1..8, tiny model, seed 0): 300 clean
    updates on every correct demo, no copying by update 450 (loss 0.20, greedy final turn 0/12); on
    the shortest quarter (depth 1..2), the transition at update ~350 and 8/12 by update 500."""


class TrainConfig(Section):
    steps: int = Field(20, ge=0)
    """RL steps (one rollout batch each)."""
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    warmup_lr_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up over this many optimiser steps."""
    max_rollout_tokens: int = Field(0, ge=0)
    """Stop once this many rollout tokens (policy + tool) were consumed (0 = no token budget)."""
    seed: int = 0
    checkpoint_every: int = Field(0, ge=0)
    """Save a checkpoint every k RL steps (0 = only at the end)."""
    grad_variance_every: int = Field(0, ge=0)
    """Every k steps, measure exact per-sample gradient variance (small models only; 0 = never)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them (HF gradient
    checkpointing, non-reentrant) during the learner's update: activation memory per token drops from
    all layers' to about one layer's, for roughly one more forward pass of compute
    (benchmarks/learner_memory_bench.py measures both). Off = keep activations (faster)."""
    warmup: WarmupConfig = Field(default_factory=WarmupConfig)


class ScaleConfig(Section):
    backend: Literal["local", "ray"] = "local"
    """local: everything in this process (the embedded default, no Ray needed); ray: rollout
    workers (and optionally learner ranks) as Ray actors."""
    address: str | None = None
    """Ray cluster address ('auto', 'ray://host:10001'); None starts a local Ray instance."""
    rollout_workers: int = Field(1, ge=1)
    """Rollout worker actors, each with its own engine and collector."""
    learner_workers: int = Field(1, ge=1)
    """Data-parallel learner ranks as Ray actors (torch.distributed: gloo on CPU, nccl on CUDA), each
    updating on whole groups of the batch with gradients summed over ranks; 1 = the learner runs
    in the driver. Needs backend 'ray'."""
    sandbox_urls: list[str] = Field(default_factory=list)
    """Sandbox services shared by all rollout workers (load-balanced); empty = each worker's own backend."""
    worker_timeout_s: float = Field(600.0, gt=0)
    """Deadline for one rollout shard, counted from its submission (one more deadline per shard
    queued ahead of it on the same worker, plus worker_start_timeout_s on a replacement that has
    not answered yet). A worker that has not answered by then is killed and replaced, and its shard
    re-run or flagged exactly as if the worker had died. Keep it well above the time of a normal shard."""
    worker_start_timeout_s: float = Field(300.0, ge=0)
    """Extra time a replacement worker gets on its first shard, for starting (imports, model load,
    weights). Why apart from worker_timeout_s: a start costs what it costs on a loaded machine
    (over 20 s was seen beside a test suite), while a shard's deadline may be tuned to seconds."""
    learner_timeout_s: float = Field(600.0, gt=0)
    """Deadline for one call to the learner ranks (scoring a shard, one update). A rank that misses
    it fails the step with an error (ranks meet in all-reduce, so one cannot be swapped mid-update);
    resume from the last checkpoint. Also the torch.distributed collective timeout."""

    learner_sharding: Literal["none", "fsdp"] = "none"
    """none: each learner rank holds a full replica of the model, its gradients and AdamW state;
    fsdp: FSDP2 (torch fully_shard) splits all three over the ranks, so each holds ~1/learner_workers
    of them (measured in benchmarks/fsdp_bench.py; docs/ray.md). Checkpoints stay full (gathered), so
    either mode resumes the other's. Needs learner_workers >= 2; not with train.grad_variance_every,
    algo.pack_tokens or an estimator needing exact per-sequence gradient norms."""
    fsdp_param_dtype: Literal["model", "bfloat16"] = "model"
    """Under fsdp, the dtype the gathered weights compute in: model = model.dtype (no casting);
    bfloat16 = bf16 mixed precision (float32 master weights and optimiser state, float32 gradient
    reduction), the usual GPU setting."""

    @model_validator(mode="after")
    def _ranks_need_ray(self) -> ScaleConfig:
        if self.learner_workers > 1 and self.backend != "ray":
            raise ValueError(
                "learner_workers > 1 runs learner ranks as Ray actors: set scale.backend=ray "
                "(or learner_workers=1 to keep the learner in this process)"
            )
        return self


class RunConfig(Section):
    name: str = "run"
    out_dir: str = "runs"
    resume: bool = True
    """Resume from the newest checkpoint in runs/<name> if one exists."""
    progress: bool = True
    """Progress bars with an ETA for the warm-up, the evaluations and the RL steps."""
    wandb: bool = False
    """Log every metric to Weights & Biases too (`pip install wandb`), besides JSONL and TensorBoard."""
    wandb_project: str = "agent-rl"
    wandb_mode: Literal["offline", "online"] = "offline"
    """offline writes the W&B run under runs/<name>/wandb for `wandb sync` later; online uploads
    as it goes (needs `wandb login`)."""


class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    scale: ScaleConfig = Field(default_factory=ScaleConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    @model_validator(mode="after")
    def _resolve_engine_defaults(self) -> Config:
        """is_correction 'auto' and the overlong ramp's budget depend on the rollout section."""
        if self.algo.is_correction == "auto":
            # Pipelined samples come from the previous weights: off-policy even on the hf engine.
            stale = self.rollout.async_steps > 0
            self.algo.is_correction = "token" if self.rollout.engine == "vllm" or stale else "off"
        if self.rollout.max_staleness < self.rollout.async_steps:
            raise ValueError(
                f"rollout.max_staleness={self.rollout.max_staleness} would drop every pipelined batch "
                f"(rollout.async_steps={self.rollout.async_steps} samples that many versions behind); "
                "set max_staleness >= async_steps"
            )
        if self.algo.overlong_max_tokens is None:
            self.algo.overlong_max_tokens = self.rollout.max_total_tokens
        if self.algo.overlong_buffer >= self.algo.overlong_max_tokens:
            raise ValueError(
                f"algo.overlong_buffer={self.algo.overlong_buffer} must be below the length budget "
                f"{self.algo.overlong_max_tokens} (rollout.max_total_tokens); lower it or set 0 for no ramp"
            )
        return self

    @model_validator(mode="after")
    def _lora_in_process(self) -> Config:
        if self.model.lora.rank and (self.scale.backend == "ray" or self.scale.learner_workers > 1):
            raise ValueError(
                "model.lora.rank > 0 runs in one process for now: Ray rollout workers and learner ranks "
                "build full models (use scale.backend: local and scale.learner_workers: 1)"
            )
        return self

    @model_validator(mode="after")
    def _fsdp_limits(self) -> Config:
        if self.scale.learner_sharding != "fsdp":
            return self
        if self.scale.learner_workers < 2:
            raise ValueError(
                "scale.learner_sharding=fsdp shards over learner ranks: set scale.learner_workers >= 2"
            )
        if self.train.grad_variance_every:
            raise ValueError(
                "train.grad_variance_every needs the full model on one rank for per-sample backward "
                "passes; not with scale.learner_sharding=fsdp"
            )
        if getattr(self.algo, "pack_tokens", None) is not None:
            raise ValueError(
                "algo.pack_tokens calls the decoder directly, bypassing FSDP's parameter gathering; "
                "not with scale.learner_sharding=fsdp"
            )
        return self

    @model_validator(mode="after")
    def _a_group_per_rank(self) -> Config:
        if self.scale.learner_workers > self.rollout.prompts_per_step:
            raise ValueError(
                f"scale.learner_workers={self.scale.learner_workers} ranks need at least as many groups: "
                f"rollout.prompts_per_step is {self.rollout.prompts_per_step} (each rank updates on whole groups)"
            )
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.run.out_dir) / self.run.name


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {key!r} is a value, not a section")
        node = child
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=c` -> ("a.b", yaml-parsed c), so `--set train.lr=1e-4` gives a float."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.path=value")
    key, raw = text.split("=", 1)
    if not key.strip():
        raise ConfigError(f"override {text!r} has an empty key")
    return key.strip(), yaml.safe_load(raw) if raw.strip() else ""


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key (value {e['input']!r}); check the spelling against the docs")
        else:
            lines.append(f"{key}: got {e['input']!r}; {e['msg']}")
    return "invalid config:\n  " + "\n  ".join(lines)


def apply_overrides(data: dict[str, Any], overrides: list[str] | None) -> dict[str, Any]:
    """A copy of the nested mapping `data` with each `a.b=c` override set (the original is untouched)."""
    tree = copy.deepcopy(data)
    for text in overrides or []:
        key, value = parse_override(text)
        _set_path(tree, key, value)
    return tree


def build_config(data: dict[str, Any] | None = None, overrides: list[str] | None = None) -> Config:
    tree = apply_overrides(dict(data or {}), overrides)
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_describe(err)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML file (or defaults when None), apply overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {str(path)!r} does not exist") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {err}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping, got {type(loaded).__name__}")
        data = loaded or {}
    return build_config(data, overrides)


def dump_config(config: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
