"""Overlong handling (DAPO, Yu et al. 2025): what the learner does with episodes a budget cut short.

Why: an episode stopped by max_turns / max_total_tokens did not fail on its merits; its reward
(usually 0) says "too long", and with a group baseline it gets pushed down as if every token
were wrong. Two remedies, selected by `algo.overlong`:

    filter:  the truncated episode's tokens get no loss term (loss weight 0). Its reward still
             counts in its group's baseline, so its siblings' advantages are unchanged.
    penalty: r_final <- r_final - penalty(L), a soft length penalty on the outcome reward, with
             L the episode's tokens (prompt included), L_max the budget and b the buffer:
                 penalty(L) = c                                      if the episode was truncated
                 penalty(L) = c * clamp((L - (L_max - b)) / b, 0, 1)   otherwise (b > 0; 0 if b == 0)

`keep` changes nothing (the default, today's behaviour).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from agent_rl.batch import RolloutBatch

__all__ = ["OverlongConfig", "overlong_loss_mask", "overlong_penalties", "shape_overlong_rewards"]


@dataclass(frozen=True)
class OverlongConfig:
    mode: str = "keep"
    """keep | filter | penalty."""
    penalty: float = 1.0
    """c: the penalty of a truncated episode and the ramp's full value."""
    buffer: int = 0
    """b: ramp width in tokens below max_tokens (0 = no ramp)."""
    max_tokens: int | None = None
    """L_max: the episode budget the ramp ends at (needed when buffer > 0)."""

    def __post_init__(self) -> None:
        if self.mode not in ("keep", "filter", "penalty"):
            raise ValueError(f"overlong mode {self.mode!r} unknown; choose keep, filter or penalty")
        if self.buffer > 0 and (self.max_tokens is None or self.buffer >= self.max_tokens):
            raise ValueError(
                "an overlong ramp (buffer > 0) needs max_tokens > buffer (rollout.max_total_tokens)"
            )


def _truncated(batch: RolloutBatch) -> torch.Tensor:
    if batch.truncated is None:
        raise ValueError(
            "overlong handling needs RolloutBatch.truncated (collate fills it from the trajectories' stop "
            "reasons; batch_from_tensors(truncated=...) for hand-made batches), or set algo.overlong=keep"
        )
    return batch.truncated.bool()


def overlong_penalties(batch: RolloutBatch, config: OverlongConfig) -> torch.Tensor:
    """(B,) float: the penalty each row's outcome reward loses (0 on invalid rows)."""
    truncated = _truncated(batch)
    penalty = torch.where(truncated, config.penalty, 0.0).float()  # (B,)
    if config.buffer > 0:
        assert config.max_tokens is not None
        lengths = batch.attention_mask.sum(1).float()  # (B,) prompt + response tokens
        ramp = ((lengths - (config.max_tokens - config.buffer)) / config.buffer).clamp(0.0, 1.0)
        penalty = torch.maximum(penalty, config.penalty * ramp)
    return torch.where(batch.valid, penalty, torch.zeros_like(penalty))


def shape_overlong_rewards(batch: RolloutBatch, config: OverlongConfig) -> RolloutBatch:
    """The batch with each row's penalty subtracted on its last policy token (mode penalty only)."""
    if config.mode != "penalty":
        return batch
    penalty = overlong_penalties(batch, config)  # (B,)
    mask = batch.policy_mask  # (B, R)
    has_tokens = mask.any(1)  # (B,)
    last = mask.shape[1] - 1 - mask.flip(1).long().argmax(1)  # (B,) index of the last policy token
    rewards = batch.token_rewards.clone()  # (B, R)
    rows = has_tokens.nonzero(as_tuple=True)[0]
    rewards[rows, last[rows]] -= penalty[rows].to(rewards.dtype)
    return replace(batch, token_rewards=rewards)


def overlong_loss_mask(batch: RolloutBatch, config: OverlongConfig) -> torch.Tensor | None:
    """(B, R) float loss weights with the truncated rows at 0 (mode filter), else None."""
    if config.mode != "filter":
        return None
    keep = ~_truncated(batch)  # (B,)
    return keep[:, None].expand_as(batch.policy_mask).float()
