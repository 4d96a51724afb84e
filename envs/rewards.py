"""Reward settings: outcome reward 1/0 plus optional format penalties.

The outcome reward is paid on the step that ends the episode; penalties for malformed tool calls
are paid on the step where they happen, so the per-step reward interface is exercised even by the
default configuration (an episode's return is the sum of its step rewards).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RewardConfig:
    """Values of the outcome and of each penalty. Defaults: pure 1/0 outcome reward."""

    correct: float = 1.0
    """Paid when the verified final answer matches."""
    wrong: float = 0.0
    """Paid when the final answer does not match, or there is none."""
    malformed_call_penalty: float = 0.0
    """Subtracted on each turn that contains a malformed tool call (>= 0)."""
    no_answer_penalty: float = 0.0
    """Subtracted when the episode ends without a final answer (>= 0)."""

    def __post_init__(self) -> None:
        if self.malformed_call_penalty < 0 or self.no_answer_penalty < 0:
            raise ValueError("penalties are magnitudes: pass them as non-negative numbers")
        if self.correct < self.wrong:
            raise ValueError(f"correct ({self.correct}) must be >= wrong ({self.wrong})")
