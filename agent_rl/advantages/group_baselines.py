"""Group-constant baselines shipped beside OTB, behind the same interface: GRPO, RLOO, OPO, REINFORCE.

Shared conventions (so estimators agree where theory says they must):
- R_i = sum_t r_t m_t is the sequence return; its advantage is broadcast onto the policy tokens.
- Invalid sequences (infrastructure failures) do not enter any group statistic and get 0.
- A group with one valid member gets no baseline (A = R), as in OTB.
"""

from __future__ import annotations

import torch

from agent_rl.advantages.common import broadcast_to_tokens, group_sum, reward_to_go, sequence_returns
from agent_rl.advantages.inputs import AdvantageInputs, group_ids_to_tensor
from agent_rl.advantages.registry import register_estimator

__all__ = ["grpo", "opo", "reinforce", "rloo"]


def _group_setup(
    inputs: AdvantageInputs,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """-> mask (B, L) bool, R (B,), member (B,) 0/1, group_ids (B,), number of groups."""
    mask = inputs.policy_mask  # (B, L)
    dtype = torch.promote_types(inputs.token_rewards.dtype, torch.float32)
    returns = sequence_returns(inputs.token_rewards.to(dtype), mask)  # (B,)
    member = torch.ones_like(returns) if inputs.valid is None else inputs.valid.to(dtype)  # (B,)
    group_ids = group_ids_to_tensor(inputs.group_index, returns.device)  # (B,)
    num_groups = int(group_ids.max()) + 1 if group_ids.numel() else 0
    return mask, returns * member, member, group_ids, num_groups


@register_estimator("grpo")
def grpo(inputs: AdvantageInputs, *, scale_by_std: bool = False, std_eps: float = 1e-6) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): A_i = (R_i - mean_group R) [/ (std_group R + eps)]. (B, L).

    Theory: the group mean is an unbiased-in-the-limit constant baseline; std scaling (off by default,
    following Dr. GRPO, Liu et al. 2025) re-weights prompts by difficulty and biases the gradient.
    The std is the unbiased sample std over the valid members.
    """
    mask, returns, member, group_ids, num_groups = _group_setup(inputs)
    size = group_sum(member, group_ids, num_groups)  # (G,)
    mean = group_sum(returns, group_ids, num_groups) / size.clamp_min(1.0)  # (G,)
    centred = (returns - mean[group_ids]) * member  # (B,)
    single = size[group_ids] <= 1  # (B,) no baseline for a group of one
    adv = torch.where(single, returns, centred)
    if scale_by_std:
        var = group_sum(centred.square(), group_ids, num_groups) / (size - 1.0).clamp_min(1.0)  # (G,)
        std = var.sqrt()[group_ids]  # (B,)
        adv = torch.where(single, adv, adv / (std + std_eps))
    return broadcast_to_tokens(adv * member, mask)


@register_estimator("rloo")
def rloo(inputs: AdvantageInputs) -> torch.Tensor:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024): A_i = R_i - mean of the other N-1. (B, L).

    Theory: the leave-one-out baseline is independent of sample i, so the estimator is unbiased;
    A_rloo = N/(N-1) * A_grpo(no std) exactly.
    """
    mask, returns, member, group_ids, num_groups = _group_setup(inputs)
    size = group_sum(member, group_ids, num_groups)[group_ids]  # (B,)
    total = group_sum(returns, group_ids, num_groups)[group_ids]  # (B,)
    others = (total - returns) / (size - 1.0).clamp_min(1.0)  # (B,)
    adv = torch.where(size <= 1, returns, returns - others)
    return broadcast_to_tokens(adv * member, mask)


@register_estimator("opo")
def opo(inputs: AdvantageInputs) -> torch.Tensor:
    """OPO (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline"): b = sum L_i R_i / sum L_i. (B, L).

    Theory: if every token's score has the same squared norm, ||g_i||^2 is proportional to the
    sequence length L_i (policy tokens), and the optimal constant baseline is the length-weighted mean.
    """
    mask, returns, member, group_ids, num_groups = _group_setup(inputs)
    lengths = mask.sum(1).to(returns.dtype)  # (B,) policy tokens; 0 for invalid rows
    size = group_sum(member, group_ids, num_groups)[group_ids]  # (B,)
    num = group_sum(lengths * returns, group_ids, num_groups)  # (G,)
    den = group_sum(lengths, group_ids, num_groups).clamp_min(1.0)  # (G,)
    baseline = (num / den)[group_ids]  # (B,)
    adv = torch.where(size <= 1, returns, returns - baseline)
    return broadcast_to_tokens(adv * member, mask)


@register_estimator("reinforce")
def reinforce(inputs: AdvantageInputs) -> torch.Tensor:
    """REINFORCE without a baseline (Williams 1992): A_t = G_t, the reward-to-go. (B, L).

    Theory: unbiased, highest variance; the reference the baselines are measured against.
    With one outcome reward G_t = R on every policy token.
    """
    mask = inputs.policy_mask  # (B, L)
    dtype = torch.promote_types(inputs.token_rewards.dtype, torch.float32)
    returns = reward_to_go(inputs.token_rewards.to(dtype), mask)  # (B, L)
    return torch.where(mask, returns, torch.zeros_like(returns))
