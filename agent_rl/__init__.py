"""agent-rl: train LLM agents that reason with tools over many turns.

Data flows one way: env -> rollout -> trajectory -> advantages -> loss -> update -> weight sync.
"""

from __future__ import annotations

__version__ = "0.1.0"
