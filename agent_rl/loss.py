"""PPO-clip policy loss with token-level aggregation, optional dual clip, KL to a reference and entropy.

Names follow the papers and cleanrl: `ratio`, `pg_loss1`, `pg_loss2`, `clipfrac`, `approx_kl`.
Metrics are returned as detached 0-dim tensors under the `losses/` prefix (no device sync here;
the trainer calls `.item()` when it logs).

Masking: a token contributes exactly 0 (value and gradient) when its response_mask is 0 or its
sequence is invalid (infrastructure failure). Garbage there (inf/NaN log-probs of padding) cannot
leak: log-ratios are zeroed with `torch.where` *before* `exp`, so no 0 * inf appears in backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "AGG_MODES",
    "KL_ESTIMATORS",
    "PPOLossConfig",
    "PPOLossOutput",
    "aggregate",
    "kl_penalty",
    "ppo_loss",
]

AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
KLEstimator = Literal["k1", "k2", "k3"]
AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


@dataclass(frozen=True)
class PPOLossConfig:
    """Hyper-parameters of the PPO-clip objective (Schulman et al. 2017)."""

    # --- clipping
    clip_ratio_low: float = 0.2
    """epsilon_low: ratio is clipped below at 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """epsilon_high: ratio is clipped above at 1 + clip_ratio_high (> low = DAPO's clip-higher)."""
    dual_clip: float | None = None
    """c in dual-clip PPO (Ye et al. 2020): for A < 0 the loss is capped at -c * A. None = off; needs c > 1."""
    # --- aggregation
    loss_agg_mode: AggMode = "token-mean"
    """token-mean: mean over all policy tokens (DAPO); seq-mean-token-sum: mean over sequences of the
    per-sequence token sum (Dr. GRPO style, scale ~ length); seq-mean-token-mean: mean over sequences
    of the per-sequence token mean (original GRPO)."""
    # --- regularisers
    kl_coef: float = 0.0
    """beta: weight of KL(pi || pi_ref) in the loss; 0 = no reference policy needed."""
    kl_estimator: KLEstimator = "k3"
    """Per-token KL estimator (Schulman 2020, "Approximating KL divergence"): k1 unbiased, k3 low variance."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss); needs `entropy`."""

    def __post_init__(self) -> None:
        if not (0.0 <= self.clip_ratio_low < 1.0) or self.clip_ratio_high < 0.0:
            raise ValueError("clip ratios must satisfy 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (typical 3.0) or None to disable; got {self.dual_clip}")
        if self.loss_agg_mode not in AGG_MODES:
            raise ValueError(f"loss_agg_mode {self.loss_agg_mode!r} unknown; choose one of {AGG_MODES}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator {self.kl_estimator!r} unknown; choose one of {KL_ESTIMATORS}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError("kl_coef and entropy_coef must be >= 0 (set 0 to disable)")


@dataclass(frozen=True)
class PPOLossOutput:
    loss: torch.Tensor
    """0-dim, differentiable."""
    metrics: dict[str, torch.Tensor]
    """Detached 0-dim tensors, keys under `losses/`."""


def aggregate(
    values: torch.Tensor, mask: torch.Tensor, mode: str, denominator: float | torch.Tensor | None = None
) -> torch.Tensor:
    """Reduce (B, L) per-token values over mask == 1 to a scalar by `mode`.

    denominator: for gradient accumulation, the number of tokens (token-mean) or sequences
    (seq-* modes) in the whole mini-batch, so that summed micro-batch losses equal the full-batch
    loss. None = this batch's own count (clamped to >= 1, so an all-masked batch gives 0, not NaN).
    """
    zero = torch.zeros_like(values)
    masked = torch.where(mask, values, zero)  # (B, L)
    if mode == "token-mean":
        total, count = masked.sum(), mask.sum()
    elif mode == "seq-mean-token-sum":
        has_tokens = mask.any(1)  # (B,)
        total, count = masked.sum(1).sum(), has_tokens.sum()
    elif mode == "seq-mean-token-mean":
        lengths = mask.sum(1)  # (B,)
        per_seq = masked.sum(1) / lengths.clamp_min(1)  # (B,)
        total, count = per_seq.sum(), (lengths > 0).sum()
    else:
        raise ValueError(f"loss_agg_mode {mode!r} unknown; choose one of {AGG_MODES}")
    if denominator is None:
        denominator = count.clamp_min(1).to(values.dtype)
    return total / denominator


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi. (B, L).

    k1 = log r, k2 = (log r)^2 / 2, k3 = (1/r - 1) + log r with r = pi / pi_ref (k3 >= 0, low variance).
    """
    log_ratio = log_probs - ref_log_probs  # (B, L) log r
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"kl_estimator {estimator!r} unknown; choose one of {KL_ESTIMATORS}")


def ppo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PPOLossConfig = PPOLossConfig(),
    *,
    valid: torch.Tensor | None = None,
    ref_log_probs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    denominator: float | torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> PPOLossOutput:
    """PPO-clip loss (to minimise) and metrics.

    log_probs:      (B, L) log pi_theta(y_t), differentiable (e.g. agent_rl.logprobs.TokenStats.log_probs).
    old_log_probs:  (B, L) log pi_old(y_t) from the rollout policy, no grad.
    advantages:     (B, L) from agent_rl.advantages.
    response_mask:  (B, L) 1 = policy token.
    valid:          (B,) bool; False rows (infrastructure failures) are excluded entirely.
    ref_log_probs:  (B, L) log pi_ref(y_t); required when config.kl_coef > 0.
    entropy:        (B, L) policy entropy, differentiable; required when config.entropy_coef > 0.
    denominator:    see `aggregate`; pass the mini-batch count when accumulating gradients.
    is_weights:     (B, L) truncated importance weights pi_trainer / pi_sampler (agent_rl.offpolicy),
                    multiplying each token's clipped term (decoupled PPO: the clip is around the
                    trainer's old policy, the weight corrects for having sampled from another one).
                    Detached; a weight of 0 removes the token's term but keeps it in the denominator.
    """
    _check_inputs(log_probs, old_log_probs, advantages, response_mask, config, ref_log_probs, entropy)
    mask = response_mask.bool()  # (B, L)
    if valid is not None:
        mask = mask & valid.bool()[:, None]
    zero = torch.zeros_like(log_probs)
    old_log_probs = old_log_probs.detach()
    advantages = torch.where(mask, advantages.detach().to(log_probs.dtype), zero)  # (B, L)

    log_ratio = torch.where(mask, log_probs - old_log_probs, zero)  # (B, L) zero before exp: no inf
    ratio = log_ratio.exp()  # (B, L)
    pg_loss1 = -advantages * ratio  # (B, L)
    pg_loss2 = -advantages * ratio.clamp(1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high)  # (B, L)
    pg_loss_clip = torch.maximum(pg_loss1, pg_loss2)  # (B, L)
    pg_losses = pg_loss_clip
    if config.dual_clip is not None:
        pg_loss3 = -advantages * config.dual_clip  # (B, L) cap for negative advantages
        pg_losses = torch.where(advantages < 0, torch.minimum(pg_loss_clip, pg_loss3), pg_loss_clip)
    pg_losses = _importance_weighted(pg_losses, is_weights, mask)
    pg_loss = aggregate(pg_losses, mask, config.loss_agg_mode, denominator)

    regulariser, metrics = _regularisers(log_probs, mask, config, ref_log_probs, entropy, denominator)
    loss = pg_loss + regulariser
    metrics.update(_clip_metrics(ratio, log_ratio, pg_loss1, pg_loss2, advantages, mask, config))
    if config.dual_clip is not None:
        with torch.no_grad():
            dual = (advantages < 0) & (pg_loss3 < pg_loss_clip) & mask
            metrics["losses/dual_clipfrac"] = dual.sum() / mask.sum().clamp_min(1)
    metrics["losses/pg_loss"] = pg_loss.detach()
    metrics["losses/loss"] = loss.detach()
    return PPOLossOutput(loss=loss, metrics=metrics)


def _importance_weighted(
    pg_losses: torch.Tensor, is_weights: torch.Tensor | None, mask: torch.Tensor
) -> torch.Tensor:
    """pg_losses * is_weights on the mask (detached weights; a 0 weight removes the term). (B, L)."""
    if is_weights is None:
        return pg_losses
    if is_weights.shape != pg_losses.shape:
        raise ValueError(
            f"is_weights shape {tuple(is_weights.shape)} != log_probs shape {tuple(pg_losses.shape)}"
        )
    weights = torch.where(mask, is_weights.detach().to(pg_losses.dtype), torch.zeros_like(pg_losses))
    return pg_losses * weights


def _check_inputs(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PPOLossConfig,
    ref_log_probs: torch.Tensor | None,
    entropy: torch.Tensor | None,
) -> None:
    for name, t in (
        ("old_log_probs", old_log_probs),
        ("advantages", advantages),
        ("response_mask", response_mask),
    ):
        if t.shape != log_probs.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != log_probs shape {tuple(log_probs.shape)}")
    if config.kl_coef > 0 and ref_log_probs is None:
        raise ValueError(
            "kl_coef > 0 needs ref_log_probs (log-probs under the reference policy); or set kl_coef=0"
        )
    if config.entropy_coef > 0 and entropy is None:
        raise ValueError("entropy_coef > 0 needs the per-token entropy; compute it with agent_rl.logprobs")


def _regularisers(
    log_probs: torch.Tensor,
    mask: torch.Tensor,
    config: PPOLossConfig,
    ref_log_probs: torch.Tensor | None,
    entropy: torch.Tensor | None,
    denominator: float | torch.Tensor | None,
) -> tuple[torch.Tensor | float, dict[str, torch.Tensor]]:
    """The KL-to-reference penalty minus the entropy bonus (aggregated like the policy loss), and
    their values as metrics whenever the inputs are there, even at coefficient 0."""
    zero, mode = torch.zeros_like(log_probs), config.loss_agg_mode
    total: torch.Tensor | float = 0.0
    metrics: dict[str, torch.Tensor] = {}
    if ref_log_probs is not None:
        ref = torch.where(mask, ref_log_probs.detach().to(log_probs.dtype), zero)
        kl = kl_penalty(torch.where(mask, log_probs, zero), ref, config.kl_estimator)  # (B, L)
        kl_loss = aggregate(kl, mask, mode, denominator)
        if config.kl_coef > 0:
            total = total + config.kl_coef * kl_loss
        metrics["losses/kl_ref"] = kl_loss.detach()
    if entropy is not None:
        entropy_mean = aggregate(torch.where(mask, entropy, zero), mask, mode, denominator)
        if config.entropy_coef > 0:
            total = total - config.entropy_coef * entropy_mean
        metrics["losses/entropy"] = entropy_mean.detach()
    return total, metrics


@torch.no_grad()
def _clip_metrics(
    ratio: torch.Tensor,
    log_ratio: torch.Tensor,
    pg_loss1: torch.Tensor,
    pg_loss2: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: PPOLossConfig,
) -> dict[str, torch.Tensor]:
    """Token means over `mask` of how far the policy moved and how often the clip bit; the ratio's
    extremes; the token count (the learner combines micro-batches by it)."""
    n_tokens = mask.sum().clamp_min(1)

    def token_mean(x: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, x, torch.zeros_like(x)).sum() / n_tokens

    clipped = (ratio < 1.0 - config.clip_ratio_low) | (ratio > 1.0 + config.clip_ratio_high)
    big = torch.finfo(ratio.dtype).max
    any_token = bool(mask.any())
    return {
        "losses/clipfrac": token_mean(clipped.to(ratio.dtype)),
        "losses/pg_clipfrac": token_mean((pg_loss2 > pg_loss1).to(ratio.dtype)),
        "losses/approx_kl": token_mean((ratio - 1.0) - log_ratio),  # k3 of (old || new)
        "losses/old_approx_kl": token_mean(-log_ratio),
        "losses/ratio_mean": token_mean(ratio),
        "losses/ratio_max": torch.where(mask, ratio, torch.full_like(ratio, -big)).max()
        if any_token
        else ratio.new_tensor(1.0),
        "losses/ratio_min": torch.where(mask, ratio, torch.full_like(ratio, big)).min()
        if any_token
        else ratio.new_tensor(1.0),
        "losses/n_tokens": mask.sum().to(ratio.dtype),
    }
