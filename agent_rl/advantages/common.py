"""Small tensor helpers shared by the estimators: group sums, returns, broadcasting."""

from __future__ import annotations

import torch

__all__ = ["broadcast_to_tokens", "group_sum", "reward_to_go", "sequence_returns"]


def group_sum(values: torch.Tensor, group_ids: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Sum rows of `values` (B, ...) per group -> (num_groups, ...). Vectorised over groups."""
    out = torch.zeros((num_groups, *values.shape[1:]), dtype=values.dtype, device=values.device)
    return out.index_add_(0, group_ids, values)


def reward_to_go(token_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """G_t = sum_{j >= t} r_j m_j, (B, L). With one outcome reward, G_t = R on every earlier token."""
    masked = torch.where(mask, token_rewards, torch.zeros_like(token_rewards))  # (B, L)
    return masked.flip(1).cumsum(1).flip(1)  # (B, L)


def sequence_returns(token_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """R_i = sum_t r_t m_t, (B,): the sequence score used by the group-constant baselines."""
    return torch.where(mask, token_rewards, torch.zeros_like(token_rewards)).sum(1)


def broadcast_to_tokens(seq_advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, L): the sequence's advantage on its policy tokens, exactly 0 elsewhere."""
    expanded = seq_advantages[:, None].expand(mask.shape)  # (B, L)
    return torch.where(mask, expanded, torch.zeros_like(expanded))
