"""The generation-engine contract every sampler (transformers, vLLM, a scripted fake) fulfils.

Why tokens in and tokens out: the trainer must score exactly the ids the sampler produced. An
engine that takes or returns text invites re-tokenisation, and re-tokenisation is where
multi-turn RL silently drifts (a merged byte pair, a shifted special token, a mask off by one).

Log-prob convention (identical for every engine, checked by the shared contract tests):
    log_probs[t] = log softmax(filter_top_p(logits_t / temperature))[token_t]
i.e. the log-probability under the distribution the token was actually drawn from, after
temperature and after top-p truncation and renormalisation (vLLM's "processed_logprobs").
With top_p = 1 this equals the trainer's `log_softmax(logits / temperature)` exactly. With
top_p < 1 it is larger than that by -log(nucleus mass); a trainer that uses top_p < 1 must
apply the same filter when it recomputes log-probs. temperature = 0 means greedy decoding and
its log-probs are reported under the untempered (temperature 1), unfiltered distribution.

Everything crossing this boundary is a plain dataclass of lists, so an engine can later live in
another process (Ray actor, RPC) without changing callers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one sequence. One instance may be shared by a whole batch."""

    temperature: float = 1.0
    """Softmax temperature; 0 = greedy (log-probs then reported at temperature 1)."""
    top_p: float = 1.0
    """Nucleus mass kept before sampling; 1 keeps the whole vocabulary (on-policy log-probs)."""
    max_new_tokens: int = 64
    """Upper bound on sampled tokens; reaching it gives finish_reason 'length'."""
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends after the token whose decoding completes one. The ids are
    kept exactly as sampled (the stop string stays in the output; nothing is trimmed)."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop ids besides the model's eos; the stop id itself is part of the output."""
    seed: int | None = None
    """Per-sequence seed. The same seed and prefix give the same sample on the same engine,
    whatever else shares the batch. None draws from the engine's own generator."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        # Lists are accepted for convenience but stored as tuples so instances stay hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    def with_(self, **changes: Any) -> SamplingParams:
        """A copy with some fields changed (e.g. a per-sequence seed or a smaller token budget)."""
        return replace(self, **changes)


@dataclass
class Completion:
    """What an engine returns for one sequence."""

    token_ids: list[int]
    """Sampled ids exactly as sampled, including a final eos / stop id when one ended the turn."""
    log_probs: list[float]
    """One log-prob per sampled id, under the convention in this module's docstring."""
    finish_reason: FinishReason
    """'stop' (eos, a stop id or a stop string) or 'length' (max_new_tokens reached)."""
    stop_reason: int | str | None = None
    """The id or string that stopped generation; None for eos-free 'length' finishes."""
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.log_probs):
            raise AssertionError(
                f"engine bug: {len(self.token_ids)} sampled ids but {len(self.log_probs)} log-probs"
            )


@runtime_checkable
class Engine(Protocol):
    """A batched token-id sampler whose weights the trainer can replace in place."""

    eos_token_id: int
    """Generation stops after this id; it is included in the returned ids."""
    max_model_len: int
    """Longest prefix + completion the engine accepts."""

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Completion]:
        """Sample one completion per prompt; `params` is shared or one per prompt."""
        ...

    def update_weights(self, state_dict: Mapping[str, Any]) -> None:
        """Load the trainer's current weights without restarting the engine."""
        ...


def per_prompt_params(
    prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams], max_model_len: int
) -> list[SamplingParams]:
    """Validate a generate() call and return one SamplingParams per prompt.

    Shared by all engines so that bad input fails identically (and before any compute) everywhere.
    """
    if isinstance(params, SamplingParams):
        plist = [params] * len(prompts)
    else:
        plist = list(params)
        if len(plist) != len(prompts):
            raise ValueError(
                f"got {len(prompts)} prompts but {len(plist)} SamplingParams; pass one or one each"
            )
    for i, (prompt, p) in enumerate(zip(prompts, plist, strict=True)):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty; every sequence needs at least one token")
        if len(prompt) + p.max_new_tokens > max_model_len:
            raise ValueError(
                f"prompt {i}: {len(prompt)} prompt tokens + max_new_tokens {p.max_new_tokens} exceed "
                f"max_model_len {max_model_len}; lower max_new_tokens or raise max_model_len"
            )
    return plist


def find_stop_string(text: str, stops: Sequence[str]) -> str | None:
    """The first stop string contained in `text`, if any."""
    for s in stops:
        if s and s in text:
            return s
    return None
