"""The Optimal Token Baseline (OTB), single-turn and tool-integrated (TIR), and its exact diagnostic.

Paper: "The Optimal Token Baseline: Variance Reduction for Long-Horizon LLM-RL" (arXiv 2602.07078).
The maths, edge cases included, is in docs/otb.md; this module follows it symbol for symbol:

    w_t   = (1 - 2 p_t(y_t) + sum_v p_t(v)^2) * rho_t^2     logit-gradient proxy of ||grad log p(y_t)||^2
    W_t^i = sum_{j <= t} w_j^i m_j^i                       cumulative weight (masked prefix sum)
    G_t^i = sum_{j >= t} r_j^i m_j^i                       reward-to-go
    b_t   = sum_i G_t^i W_t^i m_t^i / (sum_i W_t^i m_t^i + 1e-8)
    A_t^i = (G_t^i - b_t) m_t^i

Edge cases: no std normalisation; a group with one (valid) member gets no baseline (A = G); with
`handle_zero_tail` a position where only one member of the group is active gets baseline 0 (else
b_t would equal that member's own G and cancel its signal). "Active" means mask 1 on a valid
sequence, so with contiguous masks this is exactly "past the second-longest response".
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from agent_rl.advantages.common import group_sum, reward_to_go
from agent_rl.advantages.inputs import AdvantageInputs, group_ids_to_tensor
from agent_rl.advantages.registry import register_estimator

__all__ = ["OTB_EPS", "logit_gradient_proxy", "optimal_token_baseline", "token_baseline_advantages"]

OTB_EPS = 1e-8
"""Added to the baseline's denominator, as in the paper."""


def _work_dtype(t: torch.Tensor) -> torch.dtype:
    """Accumulate in at least float32: prefix sums over thousands of bf16 tokens lose the signal."""
    return torch.promote_types(t.dtype, torch.float32)


def logit_gradient_proxy(
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    response_mask: torch.Tensor,
    is_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token proxy w_t = ||e_y - p||^2 = 1 - 2 p(y) + sum p^2 (times rho^2), 0 off the mask. (B, L).

    Theory: for a softmax policy the gradient of log p(y) w.r.t. the logits is e_y - p; its squared
    norm stands in for the parameter-gradient norm at forward-pass cost. Clamped at 0 because
    (1 - p)^2 <= w can round to a tiny negative value when p(y) ~ 1, and W must stay a weight.
    """
    dtype = _work_dtype(old_log_probs)
    p_sampled = old_log_probs.to(dtype).exp()  # (B, L)
    w = (1.0 - 2.0 * p_sampled + sum_pi_squared.to(dtype)).clamp_min(0.0)  # (B, L)
    if is_weights is not None:
        w = w * is_weights.to(dtype).square()
    return torch.where(response_mask.bool(), w, torch.zeros_like(w))


def _per_position_advantages(
    returns: torch.Tensor,
    cum_weights: torch.Tensor,
    active: torch.Tensor,
    group_ids: torch.Tensor,
    group_size: torch.Tensor,
    handle_zero_tail: bool,
) -> torch.Tensor:
    """A_t = (G_t - b_t) m_t with b_t the W-weighted group mean of G at the same column t. (B, T)."""
    num_groups = int(group_size.shape[0])
    zeros = torch.zeros_like(returns)
    weighted = torch.where(active, cum_weights * returns, zeros)  # (B, T)  G W m
    weights = torch.where(active, cum_weights, zeros)  # (B, T)  W m
    num = group_sum(weighted, group_ids, num_groups)  # (G, T)
    den = group_sum(weights, group_ids, num_groups)  # (G, T)
    baseline = (num / (den + OTB_EPS))[group_ids]  # (B, T)
    no_baseline = (group_size[group_ids] <= 1)[:, None].expand_as(active)  # (B, T)
    if handle_zero_tail:
        n_active = group_sum(active.to(returns.dtype), group_ids, num_groups)[group_ids]  # (B, T)
        no_baseline = no_baseline | (n_active <= 1)
    baseline = torch.where(no_baseline, zeros, baseline)
    return torch.where(active, returns - baseline, zeros)


def token_baseline_advantages(
    returns: torch.Tensor,
    weights: torch.Tensor,
    policy_mask: torch.Tensor,
    group_ids: torch.Tensor,
    valid: torch.Tensor | None = None,
    *,
    multi_turn: bool = False,
    handle_zero_tail: bool = True,
    cumulative: bool = False,
) -> torch.Tensor:
    """The per-token optimal-baseline rule for any per-token weight (proxy or exact). (B, L).

    Theory: b*_t = E[||S_t||^2 G_t] / E[||S_t||^2] with S_t the prefix score; ||S_t||^2 ~ W_t because
    per-token scores are martingale differences, so their squared norms add.

    returns:     (B, L) reward-to-go G.
    weights:     (B, L) per-token w (prefix-summed here) or, with cumulative=True, W itself.
    policy_mask: (B, L) bool, already False on invalid sequences.
    group_ids:   (B,) long, dense 0..G-1.
    valid:       (B,) bool or None; only valid members count toward a group's size.
    multi_turn:  align the group on the k-th policy token instead of the absolute position (TIR).
    """
    active = policy_mask.bool()
    zeros = torch.zeros_like(weights)
    if cumulative:
        cum_weights = weights
    else:
        cum_weights = torch.where(active, weights, zeros).cumsum(1)  # (B, L) W_t
    members = torch.ones_like(group_ids, dtype=returns.dtype) if valid is None else valid.to(returns.dtype)
    num_groups = int(group_ids.max()) + 1 if group_ids.numel() else 0
    group_size = group_sum(members, group_ids, num_groups)  # (G,)
    if not multi_turn:
        return _per_position_advantages(returns, cum_weights, active, group_ids, group_size, handle_zero_tail)

    # TIR: compact each row to its policy tokens (k = 0..K_i-1), apply the rule along k, scatter back.
    # W and G are unchanged by compaction: masked tokens add nothing to either sum.
    rows, cols = active.nonzero(as_tuple=True)  # (N,), (N,) in row-major order
    advantages = torch.zeros_like(returns)
    if rows.numel() == 0:
        return advantages
    k = (active.long().cumsum(1) - 1)[rows, cols]  # (N,) index of each policy token within its row
    width = int(k.max()) + 1
    batch = returns.shape[0]
    compact_returns = returns.new_zeros(batch, width)  # (B, K)
    compact_weights = cum_weights.new_zeros(batch, width)  # (B, K)
    compact_active = torch.zeros(batch, width, dtype=torch.bool, device=returns.device)  # (B, K)
    compact_returns[rows, k] = returns[rows, cols]
    compact_weights[rows, k] = cum_weights[rows, cols]
    compact_active[rows, k] = True
    compact_adv = _per_position_advantages(
        compact_returns, compact_weights, compact_active, group_ids, group_size, handle_zero_tail
    )  # (B, K)
    advantages[rows, cols] = compact_adv[rows, k]
    return advantages


def optimal_token_baseline(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    group_index: Sequence[Hashable] | torch.Tensor,
    *,
    multi_turn: bool = False,
    handle_zero_tail: bool = True,
    is_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """OTB advantages (B, L) from rewards and the forward-pass proxy; see the module docstring.

    Theory: per-token optimal baseline b_t = sum_i G_t W_t / sum_i W_t with the logit-gradient proxy W.

    token_rewards:  (B, L) float; response_mask: (B, L) 1 = policy token.
    old_log_probs:  (B, L) log p_old(y_t); sum_pi_squared: (B, L) sum_v p_old(v)^2.
    group_index:    B hashable ids (same id = same prompt).
    multi_turn:     TIR variant: align on the k-th policy token, tool spans get 0.
    is_weights:     (B, L) rho_t, scales the proxy by rho^2.
    """
    inputs = AdvantageInputs(
        token_rewards=token_rewards,
        response_mask=response_mask,
        group_index=group_index,
        old_log_probs=old_log_probs,
        sum_pi_squared=sum_pi_squared,
        is_weights=is_weights,
    )
    return _otb(inputs, multi_turn=multi_turn, handle_zero_tail=handle_zero_tail)


def _otb(inputs: AdvantageInputs, *, multi_turn: bool, handle_zero_tail: bool) -> torch.Tensor:
    assert inputs.old_log_probs is not None and inputs.sum_pi_squared is not None
    dtype = _work_dtype(inputs.token_rewards)
    mask = inputs.policy_mask  # (B, L)
    w = logit_gradient_proxy(inputs.old_log_probs, inputs.sum_pi_squared, mask, inputs.is_weights).to(dtype)
    returns = reward_to_go(inputs.token_rewards.to(dtype), mask)  # (B, L)
    group_ids = group_ids_to_tensor(inputs.group_index, returns.device)
    return token_baseline_advantages(
        returns, w, mask, group_ids, inputs.valid, multi_turn=multi_turn, handle_zero_tail=handle_zero_tail
    )


@register_estimator("otb", requires=("old_log_probs", "sum_pi_squared"))
def otb(inputs: AdvantageInputs, *, handle_zero_tail: bool = True) -> torch.Tensor:
    """Optimal Token Baseline, single-turn (Li et al. 2026, arXiv 2602.07078). (B, L).

    Theory: b_t = sum_i G_t^i W_t^i / (sum_i W_t^i + eps) over the group at absolute position t.
    """
    return _otb(inputs, multi_turn=False, handle_zero_tail=handle_zero_tail)


@register_estimator("tir_otb", requires=("old_log_probs", "sum_pi_squared"))
def tir_otb(inputs: AdvantageInputs, *, handle_zero_tail: bool = True) -> torch.Tensor:
    """OTB for tool-integrated, multi-turn episodes (TIR variant of arXiv 2602.07078). (B, L).

    Theory: the same rule indexed by k = "the k-th token the policy produced", since tool outputs of
    different lengths break the alignment of absolute positions; tool tokens get advantage 0.
    """
    return _otb(inputs, multi_turn=True, handle_zero_tail=handle_zero_tail)


@register_estimator("exact_optimal", requires=("grad_sq_norms",))
def exact_optimal(
    inputs: AdvantageInputs,
    *,
    multi_turn: bool = False,
    handle_zero_tail: bool = True,
    cumulative: bool = True,
) -> torch.Tensor:
    """Diagnostic: OTB's per-token rule with true squared gradient norms instead of the proxy. (B, L).

    Theory: b*_t = E[||S_t||^2 G_t] / E[||S_t||^2] evaluated with exact per-sample norms (small
    models only; see agent_rl.grad_stats), to measure how much the proxy loses.

    grad_sq_norms (B, L), cumulative=True:  W_t = ||grad of sum_{j<=t} log p(y_j)||^2, the exact prefix norm.
    grad_sq_norms (B, L), cumulative=False: per-token ||grad log p(y_t)||^2, prefix-summed like the proxy.
    grad_sq_norms (B,):  one norm per sequence, used as W at every token (the classical sequence-level
                         optimal baseline E[||g||^2 R] / E[||g||^2]).
    """
    assert inputs.grad_sq_norms is not None
    dtype = _work_dtype(inputs.token_rewards)
    mask = inputs.policy_mask  # (B, L)
    norms = inputs.grad_sq_norms.to(dtype)
    if norms.dim() == 1:
        norms, cumulative = norms[:, None].expand(mask.shape), True
    returns = reward_to_go(inputs.token_rewards.to(dtype), mask)  # (B, L)
    group_ids = group_ids_to_tensor(inputs.group_index, returns.device)
    return token_baseline_advantages(
        returns,
        norms,
        mask,
        group_ids,
        inputs.valid,
        multi_turn=multi_turn,
        handle_zero_tail=handle_zero_tail,
        cumulative=cumulative,
    )
