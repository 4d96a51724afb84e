"""The tensors between the rollout and the loss, typed: `collate` makes a RolloutBatch, the learner's
scoring pass turns it into a ScoredBatch.

Why two frozen types instead of one growing dict: each log-prob has one name for its whole life.
`sampler_log_probs` are the engine's (what the tokens were drawn with); `trainer_log_probs` are the
learner's own recomputation before the update (PPO's "old" policy, so the ratio starts at exactly 1
even when the engine differs from the trainer). The policy mask (sampled tokens of valid sequences,
the only tokens with a loss or an advantage) is computed once, here.

Shapes: B sequences, P = longest prompt, R = longest response, L = P + R.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any, TypeVar

import torch

from agent_rl.rollout.trajectory import Trajectory

T = TypeVar("T")


def _map_tensors(batch: T, fn: Any) -> T:
    """A copy of the dataclass `batch` with `fn` applied to every tensor in it (nested ones too)."""
    changes = {}
    for f in fields(batch):  # type: ignore[arg-type]
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor):
            changes[f.name] = fn(value)
        elif is_dataclass(value):
            changes[f.name] = _map_tensors(value, fn)
    return replace(batch, **changes)  # type: ignore[type-var]


@dataclass(frozen=True)
class RolloutBatch:
    """Collated trajectories: prompts left-padded, responses right-padded."""

    input_ids: torch.Tensor
    """(B, L) long: prompt then response ids, pad elsewhere."""
    attention_mask: torch.Tensor
    """(B, L) long: 1 on real tokens (tool tokens included: the policy reads them)."""
    position_ids: torch.Tensor
    """(B, L) long: 0.. over real tokens."""
    response_mask: torch.Tensor
    """(B, R) float: 1 only on tokens the policy sampled."""
    sampler_log_probs: torch.Tensor
    """(B, R) float: the engine's log-probs of the sampled tokens, 0 elsewhere."""
    token_rewards: torch.Tensor
    """(B, R) float: step rewards on their turn's last policy token."""
    group_index: torch.Tensor
    """(B,) long: samples of one task share it."""
    valid: torch.Tensor
    """(B,) bool: False for infrastructure failures (no loss, no advantage, not in any baseline)."""
    policy_mask: torch.Tensor
    """(B, R) bool: response_mask & valid, the tokens that get an advantage and a loss term."""
    truncated: torch.Tensor | None = None
    """(B,) bool: episodes cut by a budget or the env's limit (overlong handling); None = unknown."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_length(self) -> int:
        """R: the logits for the response are those of positions P-1 .. L-2."""
        return self.response_mask.shape[1]

    @property
    def responses(self) -> torch.Tensor:
        """(B, R) long: the response part of input_ids."""
        return self.input_ids[:, -self.response_length :]

    def rows(self, idx: torch.Tensor) -> RolloutBatch:
        """The sequences at `idx` (a minibatch, a micro-batch, a rank's shard)."""
        return _map_tensors(self, lambda t: t[idx])

    def to(self, device: torch.device | str) -> RolloutBatch:
        return _map_tensors(self, lambda t: t.to(device))


@dataclass(frozen=True)
class PolicyScores:
    """The current policy's view of a RolloutBatch, before the update (one no-grad pass)."""

    trainer_log_probs: torch.Tensor
    """(B, R) float: the learner's log-probs of the sampled tokens (the PPO ratio's denominator)."""
    sum_pi_squared: torch.Tensor
    """(B, R) float: sum_v pi(v)^2 at each position (OTB's collision term)."""
    entropy: torch.Tensor
    """(B, R) float: policy entropy at each position."""
    ref_log_probs: torch.Tensor | None = None
    """(B, R) float: the reference policy's log-probs, when a KL penalty is configured."""


@dataclass(frozen=True)
class ScoredBatch:
    """What the update consumes: the rollout, the policy's scores of it, and its advantages."""

    rollout: RolloutBatch
    scores: PolicyScores
    advantages: torch.Tensor
    """(B, R) float: 0 outside the policy mask."""
    grad_sq_norms: torch.Tensor | None = None
    """(B,) float: exact per-sequence squared gradient norms, when the estimator needs them."""
    is_weights: torch.Tensor | None = None
    """(B, R) float: truncated importance weights p_trainer / p_sampler (agent_rl.offpolicy); None = off."""
    loss_weights: torch.Tensor | None = None
    """(B, R) float: what multiplies each token's PPO term (IS weights, overlong filter); None = all 1."""

    def __len__(self) -> int:
        return len(self.rollout)

    @property
    def policy_mask(self) -> torch.Tensor:
        return self.rollout.policy_mask

    def rows(self, idx: torch.Tensor) -> ScoredBatch:
        return _map_tensors(self, lambda t: t[idx])

    def to(self, device: torch.device | str) -> ScoredBatch:
        return _map_tensors(self, lambda t: t.to(device))


def gather_rows(parts: Sequence[T], rows: Sequence[torch.Tensor]) -> T:
    """Batches holding `rows[i]` of one batch each, put back into one batch in the original row order."""
    order = torch.cat(list(rows))
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))
    return _join(parts, lambda tensors: torch.cat(tensors)[inverse])


def _join(parts: Sequence[T], join: Any) -> T:
    changes = {}
    for f in fields(parts[0]):  # type: ignore[arg-type]
        values = [getattr(p, f.name) for p in parts]
        if isinstance(values[0], torch.Tensor):
            changes[f.name] = join(values)
        elif is_dataclass(values[0]):
            changes[f.name] = _join(values, join)
    return replace(parts[0], **changes)  # type: ignore[type-var]


def collate(trajectories: Iterable[Trajectory], pad_id: int) -> RolloutBatch:
    """Pack trajectories into the learner's tensors (see RolloutBatch for each field)."""
    trajs = list(trajectories)
    if not trajs:
        raise ValueError("collate needs at least one trajectory")
    batch = len(trajs)
    p_len = max(len(t.prompt_ids) for t in trajs)
    r_len = max(1, max(len(t.response_ids) for t in trajs))
    input_ids = torch.full((batch, p_len + r_len), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, p_len + r_len), dtype=torch.long)
    mask = torch.zeros((batch, r_len), dtype=torch.float32)
    sampler_lp = torch.zeros((batch, r_len), dtype=torch.float32)
    rewards = torch.zeros((batch, r_len), dtype=torch.float32)
    for i, t in enumerate(trajs):
        t.check()
        n_p, n_r = len(t.prompt_ids), len(t.response_ids)
        input_ids[i, p_len - n_p : p_len] = torch.tensor(t.prompt_ids, dtype=torch.long)
        attention[i, p_len - n_p : p_len] = 1
        if n_r:
            input_ids[i, p_len : p_len + n_r] = torch.tensor(t.response_ids, dtype=torch.long)
            attention[i, p_len : p_len + n_r] = 1
            mask[i, :n_r] = torch.tensor(t.response_mask, dtype=torch.float32)
            sampler_lp[i, :n_r] = torch.tensor(t.log_probs, dtype=torch.float32)
            rewards[i, :n_r] = torch.tensor(t.token_rewards, dtype=torch.float32)
    valid = torch.tensor([t.valid for t in trajs], dtype=torch.bool)
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
        response_mask=mask,
        sampler_log_probs=sampler_lp,
        token_rewards=rewards,
        group_index=torch.tensor([t.group_id for t in trajs], dtype=torch.long),
        valid=valid,
        policy_mask=mask.bool() & valid[:, None],
        truncated=torch.tensor([t.truncated for t in trajs], dtype=torch.bool),
    )


def batch_from_tensors(
    input_ids: torch.Tensor,
    response_mask: torch.Tensor,
    sampler_log_probs: torch.Tensor,
    token_rewards: torch.Tensor,
    group_index: torch.Tensor,
    valid: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    truncated: torch.Tensor | None = None,
) -> RolloutBatch:
    """A RolloutBatch from hand-made tensors (tests, benchmarks): the derived fields filled in."""
    attention = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    valid = torch.ones(len(input_ids), dtype=torch.bool) if valid is None else valid.bool()
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
        response_mask=response_mask.float(),
        sampler_log_probs=sampler_log_probs,
        token_rewards=token_rewards,
        group_index=group_index,
        valid=valid,
        policy_mask=response_mask.bool() & valid[:, None],
        truncated=None if truncated is None else truncated.bool(),
    )
