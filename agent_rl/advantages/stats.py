"""Advantage statistics for the `adv/` metrics, computed over policy tokens only."""

from __future__ import annotations

import torch

__all__ = ["advantage_metrics"]


def advantage_metrics(advantages: torch.Tensor, mask: torch.Tensor, prefix: str = "adv/") -> dict[str, float]:
    """Mean, std, min, max, |A| mean and the zero fraction of (B, L) advantages over mask == 1."""
    values = advantages[mask.bool()].detach().float()  # (N,)
    if values.numel() == 0:
        return {f"{prefix}{k}": 0.0 for k in ("mean", "std", "min", "max", "abs_mean", "zero_frac")}
    return {
        f"{prefix}mean": values.mean().item(),
        f"{prefix}std": values.std(unbiased=False).item(),
        f"{prefix}min": values.min().item(),
        f"{prefix}max": values.max().item(),
        f"{prefix}abs_mean": values.abs().mean().item(),
        f"{prefix}zero_frac": (values == 0).float().mean().item(),
    }
