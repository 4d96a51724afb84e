"""Advantage estimators behind one interface, looked up by name.

    from agent_rl.advantages import AdvantageInputs, compute_advantages
    adv = compute_advantages("otb", AdvantageInputs(token_rewards, response_mask, group_index,
                                                     old_log_probs=..., sum_pi_squared=...))

Registered: otb, tir_otb, exact_optimal (otb.py); grpo, rloo, opo, reinforce (group_baselines.py).
`required_inputs(name)` tells the trainer which optional tensors an estimator needs.
"""

from __future__ import annotations

from agent_rl.advantages import group_baselines as _group_baselines  # noqa: F401  (registers)
from agent_rl.advantages.inputs import AdvantageInputs, group_ids_to_tensor
from agent_rl.advantages.otb import logit_gradient_proxy, optimal_token_baseline, token_baseline_advantages
from agent_rl.advantages.registry import (
    EstimatorSpec,
    available_estimators,
    compute_advantages,
    get_estimator,
    register_estimator,
    required_inputs,
    unregister_estimator,
)
from agent_rl.advantages.stats import advantage_metrics

__all__ = [
    "AdvantageInputs",
    "EstimatorSpec",
    "advantage_metrics",
    "available_estimators",
    "compute_advantages",
    "get_estimator",
    "group_ids_to_tensor",
    "logit_gradient_proxy",
    "optimal_token_baseline",
    "register_estimator",
    "required_inputs",
    "token_baseline_advantages",
    "unregister_estimator",
]
