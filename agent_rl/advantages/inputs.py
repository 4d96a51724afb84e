"""The one inputs object every advantage estimator receives.

Why one object: the trainer fills it with everything it has (rewards, masks, groups, and the
optional proxy/diagnostic tensors) and calls `compute_advantages(name, inputs)`. It never needs to
know which estimator wants which extra tensor; an estimator that lacks one raises with the fix.

Layout convention (shared by all estimators): row i is one response, column t is the t-th token
of the *response* part (position 0 = first token after the prompt). Prompt tokens are not in these
tensors; padding, and tool output in multi-turn episodes, carry `response_mask == 0`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["AdvantageInputs", "group_ids_to_tensor"]


@dataclass(frozen=True)
class AdvantageInputs:
    """Per-batch tensors for advantage estimation; shapes are checked on construction."""

    token_rewards: torch.Tensor
    """(B, L) float. Reward per token; an outcome reward sits on the last policy token (mask 1)."""
    response_mask: torch.Tensor
    """(B, L) 0/1 or bool. 1 = a token the policy generated; 0 = padding or tool output."""
    group_index: Sequence[Hashable] | torch.Tensor
    """B ids; responses with the same id were sampled for the same prompt (one group)."""
    old_log_probs: torch.Tensor | None = None
    """(B, L) float. log pi_old(y_t) of the sampled token (OTB proxy: p_t(y_t) = exp of this)."""
    sum_pi_squared: torch.Tensor | None = None
    """(B, L) float. sum_v pi_old(v)^2 at each position (the proxy's collision term)."""
    is_weights: torch.Tensor | None = None
    """(B, L) float. Importance weights rho_t (rollout/trainer mismatch); the proxy is scaled by rho^2."""
    grad_sq_norms: torch.Tensor | None = None
    """(B,) or (B, L) float. True squared gradient norms, for the `exact_optimal` diagnostic."""
    valid: torch.Tensor | None = None
    """(B,) bool. False = infrastructure failure: excluded from its group's baseline, advantage 0."""

    def __post_init__(self) -> None:
        rewards, mask = self.token_rewards, self.response_mask
        if rewards.dim() != 2:
            raise ValueError(f"token_rewards must be (B, L); got shape {tuple(rewards.shape)}")
        if mask.shape != rewards.shape:
            raise ValueError(
                f"response_mask shape {tuple(mask.shape)} != token_rewards shape {tuple(rewards.shape)}; "
                "both must be aligned on the response tokens"
            )
        batch = rewards.shape[0]
        if len(self.group_index) != batch:
            raise ValueError(f"group_index has {len(self.group_index)} ids for a batch of {batch} responses")
        for name in ("old_log_probs", "sum_pi_squared", "is_weights"):
            value = getattr(self, name)
            if value is not None and value.shape != rewards.shape:
                raise ValueError(f"{name} must have shape {tuple(rewards.shape)}; got {tuple(value.shape)}")
        norms = self.grad_sq_norms
        if norms is not None and norms.shape not in ((batch,), tuple(rewards.shape)):
            raise ValueError(
                f"grad_sq_norms must be (B,) per sequence or (B, L) per token; got {tuple(norms.shape)}"
            )
        if self.valid is not None and self.valid.shape != (batch,):
            raise ValueError(f"valid must be a (B,) bool tensor; got shape {tuple(self.valid.shape)}")
        lost = (rewards != 0) & ~mask.bool()
        if self.valid is not None:
            lost = lost & self.valid.bool()[:, None]
        if bool(lost.any()):
            row = int(lost.any(dim=1).nonzero()[0])
            raise ValueError(
                f"token_rewards is non-zero on tokens with response_mask == 0 (first in row {row}); those rewards "
                "would be silently dropped. Put an outcome reward on the last policy token (mask 1) instead"
            )

    @property
    def policy_mask(self) -> torch.Tensor:
        """(B, L) bool: response tokens of valid sequences, the only tokens that get an advantage."""
        mask = self.response_mask.bool()
        if self.valid is not None:
            mask = mask & self.valid.bool().to(mask.device)[:, None]
        return mask

    def require(self, estimator: str, *names: str) -> None:
        """Raise with the fix when an estimator needs an optional tensor that was not supplied."""
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(
                f"advantage estimator {estimator!r} needs {', '.join(missing)} in AdvantageInputs; "
                "compute them in the log-prob pass (see agent_rl.logprobs) or pick another estimator"
            )


def group_ids_to_tensor(group_index: Sequence[Hashable] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Map B hashable ids to a (B,) long tensor of dense group numbers 0..G-1 (first-seen order)."""
    if isinstance(group_index, torch.Tensor):
        group_index = group_index.tolist()
    dense: dict[Hashable, int] = {}
    ids = [dense.setdefault(g, len(dense)) for g in group_index]
    return torch.tensor(ids, dtype=torch.long, device=device)
