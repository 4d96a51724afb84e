"""Off-policy correction between the sampler and the trainer: truncated importance sampling.

Why: the tokens were drawn from the sampler's distribution (vLLM kernels, bf16, another
temperature, stale weights), but the PPO ratio is taken against the trainer's own recomputed
log-probs. The gradient we want is E_{y ~ pi_trainer}[A grad log pi]; with samples from
pi_sampler it is E_{y ~ pi_sampler}[rho A grad log pi], with the per-token importance ratio

    rho_t = pi_trainer(y_t) / pi_sampler(y_t) = exp(trainer_log_prob_t - sampler_log_prob_t)

Unbounded ratios give unbounded variance, so the weight is truncated (TIS, Espeholt et al. 2018;
Yao et al. 2025 for LLM RL) or whole sequences whose ratio is implausible are rejected:

    token:     w_t = min(rho_t, C)
    geometric: w_t = min(rho_t, C) * 1[ lo <= exp(mean_{s in seq} log rho_s) <= hi ]
    sequence:  w_t = min(rho_t, C) * 1[ lo <= exp(sum_{s in seq} log rho_s) <= hi ]

w multiplies each token's PPO term (`agent_rl.loss.ppo_loss(is_weights=...)`) and, squared, OTB's
logit-gradient proxy (`AdvantageInputs.is_weights`), as the OTB paper specifies. The weights are
detached statistics: no gradient flows through them.

Metrics (`offpolicy/`, every step, whether or not the correction is on): the mismatch
KL(sampler || trainer) estimated on the sampled tokens (k3: rho - 1 - log rho, >= 0), the largest
and 99th-percentile rho, and the fractions of policy tokens truncated (rho > C) and masked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "IS_MODES",
    "ISCorrection",
    "ISResult",
    "importance_weights",
    "mismatch_metrics",
    "resolve_mode",
]

ISMode = Literal["auto", "off", "token", "geometric", "sequence"]
IS_MODES: tuple[str, ...] = ("auto", "off", "token", "geometric", "sequence")
DEFAULT_BANDS: dict[str, tuple[float, float]] = {"geometric": (0.99, 1.01), "sequence": (0.5, 2.0)}
"""Default acceptance bands. The geometric mean is a per-token average, so its band is tight
(1% per token); the sequence product compounds over hundreds of tokens, so its band is wide."""


def resolve_mode(mode: str, engine: str) -> str:
    """'auto' -> 'off' for the HF engine (the sampler *is* the trainer's model: exactly on-policy up
    to kernel rounding) and 'token' for vLLM (other kernels, other numerics)."""
    if mode not in IS_MODES:
        raise ValueError(f"is_correction {mode!r} unknown; choose one of {IS_MODES}")
    if mode != "auto":
        return mode
    return "token" if engine == "vllm" else "off"


@dataclass(frozen=True)
class ISCorrection:
    """Which correction to apply (see the module docstring for the formulas)."""

    mode: str = "off"
    """off | token | geometric | sequence ('auto' must be resolved first, see resolve_mode)."""
    cap: float = 2.0
    """C: the truncation level of the per-token ratio (all modes but off)."""
    band: tuple[float, float] | None = None
    """[lo, hi] a sequence's geometric-mean or product ratio must lie in; None = DEFAULT_BANDS."""

    def __post_init__(self) -> None:
        if self.mode not in IS_MODES or self.mode == "auto":
            raise ValueError(f"mode must be one of off, token, geometric, sequence; got {self.mode!r}")
        if self.cap < 1.0:
            raise ValueError(
                f"is_cap must be >= 1 (C truncates rho = p_trainer/p_sampler from above); got {self.cap}"
            )
        if self.band is not None and not (0.0 <= self.band[0] < 1.0 < self.band[1]):
            raise ValueError(f"is_band must satisfy 0 <= lo < 1 < hi; got {self.band}")

    @property
    def bounds(self) -> tuple[float, float]:
        return self.band if self.band is not None else DEFAULT_BANDS.get(self.mode, (0.0, float("inf")))


@dataclass(frozen=True)
class ISResult:
    weights: torch.Tensor
    """(B, R) float: w_t on policy tokens, 0 elsewhere and on rejected sequences."""
    sequence_kept: torch.Tensor
    """(B,) bool: False for sequences the band rejected."""


def _log_ratio(
    trainer_log_probs: torch.Tensor, sampler_log_probs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """(B, R) log rho, exactly 0 off the mask (padding's log-probs can be anything)."""
    diff = trainer_log_probs.float() - sampler_log_probs.float()
    return torch.where(mask, diff, torch.zeros_like(diff))


@torch.no_grad()
def importance_weights(
    trainer_log_probs: torch.Tensor,
    sampler_log_probs: torch.Tensor,
    policy_mask: torch.Tensor,
    correction: ISCorrection,
) -> ISResult | None:
    """The truncated (and, for sequence modes, band-masked) IS weights; None when mode is off.

    trainer_log_probs, sampler_log_probs: (B, R) log-probs of the sampled tokens.
    policy_mask: (B, R) bool, the tokens that get a loss term.
    """
    if correction.mode == "off":
        return None
    mask = policy_mask.bool()
    log_rho = _log_ratio(trainer_log_probs, sampler_log_probs, mask)  # (B, R)
    # min(rho, C) computed in log space: exp of a clamped log never overflows.
    weights = log_rho.clamp(max=float(torch.tensor(correction.cap).log())).exp()  # (B, R)
    kept = torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device)  # (B,)
    if correction.mode in ("geometric", "sequence"):
        total = log_rho.sum(1)  # (B,) log of the sequence's product ratio
        if correction.mode == "geometric":
            total = total / mask.sum(1).clamp_min(1)  # (B,) log of the geometric mean
        lo, hi = correction.bounds
        log_lo = float("-inf") if lo == 0 else float(torch.tensor(lo).log())
        log_hi = float(torch.tensor(hi).log())
        kept = (total >= log_lo) & (total <= log_hi)
    weights = torch.where(mask & kept[:, None], weights, torch.zeros_like(weights))
    return ISResult(weights=weights, sequence_kept=kept)


@torch.no_grad()
def mismatch_metrics(
    trainer_log_probs: torch.Tensor,
    sampler_log_probs: torch.Tensor,
    policy_mask: torch.Tensor,
    weights: torch.Tensor | None = None,
) -> dict[str, float]:
    """How far the sampler is from the trainer on this batch, and what the correction did.

    offpolicy/mismatch_kl: mean over policy tokens of k3 = rho - 1 - log rho, an unbiased, >= 0
    estimate of KL(sampler || trainer) from the sampler's own samples (Schulman 2020).
    offpolicy/ratio_max, ratio_p99: of rho over policy tokens. With weights: truncated_frac (tokens
    whose weight is below their rho but above 0) and masked_frac (policy tokens with weight 0).
    """
    mask = policy_mask.bool()
    if not bool(mask.any()):
        return {}
    log_rho = _log_ratio(trainer_log_probs, sampler_log_probs, mask)[mask].double()  # (N,)
    rho = log_rho.exp()
    metrics = {
        "offpolicy/mismatch_kl": float((rho - 1.0 - log_rho).mean()),
        "offpolicy/ratio_max": float(rho.max()),
        "offpolicy/ratio_p99": float(torch.quantile(rho, 0.99)) if rho.numel() <= 2**24 else float(rho.max()),
        "offpolicy/ratio_min": float(rho.min()),
    }
    if weights is not None:
        w = weights[mask].double()
        metrics["offpolicy/masked_frac"] = float((w == 0).double().mean())
        metrics["offpolicy/truncated_frac"] = float(((w > 0) & (w < rho * (1 - 1e-6))).double().mean())
        metrics["offpolicy/weight_mean"] = float(w.mean())
    return metrics
