"""Advantage estimators registered by name, so the trainer never branches on which one it runs.

The trainer calls `compute_advantages(name, inputs, **options)`. It can ask `required_inputs(name)`
which optional tensors to compute (e.g. `sum_pi_squared` for OTB) without naming estimators itself.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from agent_rl.advantages.inputs import AdvantageInputs

__all__ = [
    "EstimatorFn",
    "EstimatorSpec",
    "available_estimators",
    "compute_advantages",
    "get_estimator",
    "register_estimator",
    "required_inputs",
    "unregister_estimator",
]

EstimatorFn = Callable[..., torch.Tensor]
"""fn(inputs: AdvantageInputs, **options) -> (B, L) advantages, exactly 0 where the policy mask is 0."""


@dataclass(frozen=True)
class EstimatorSpec:
    name: str
    fn: EstimatorFn
    requires: tuple[str, ...]
    """Optional AdvantageInputs fields this estimator cannot run without."""
    options: tuple[str, ...]
    """Keyword options the estimator accepts (its keyword-only parameters)."""


_REGISTRY: dict[str, EstimatorSpec] = {}


def register_estimator(name: str, *, requires: tuple[str, ...] = ()) -> Callable[[EstimatorFn], EstimatorFn]:
    """Decorator: register `fn(inputs, *, option=...)` under `name`. A duplicate name raises."""
    unknown = set(requires) - set(AdvantageInputs.__dataclass_fields__)
    if unknown:
        raise ValueError(f"requires names unknown AdvantageInputs fields: {sorted(unknown)}")

    def decorator(fn: EstimatorFn) -> EstimatorFn:
        if name in _REGISTRY:
            raise ValueError(
                f"advantage estimator {name!r} is already registered (by {_REGISTRY[name].fn.__qualname__}); "
                "pick another name or unregister_estimator() the old one first"
            )
        params = inspect.signature(fn).parameters.values()
        options = tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)
        _REGISTRY[name] = EstimatorSpec(name=name, fn=fn, requires=tuple(requires), options=options)
        return fn

    return decorator


def unregister_estimator(name: str) -> None:
    """Remove a registration (tests use this to clean up what they registered)."""
    get_estimator(name)
    del _REGISTRY[name]


def available_estimators() -> list[str]:
    return sorted(_REGISTRY)


def get_estimator(name: str) -> EstimatorSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"unknown advantage estimator {name!r}; valid names: {', '.join(available_estimators())}"
        ) from None


def required_inputs(name: str) -> tuple[str, ...]:
    """Optional AdvantageInputs fields the named estimator needs (so the trainer computes only those)."""
    return get_estimator(name).requires


def compute_advantages(name: str, inputs: AdvantageInputs, **options: object) -> torch.Tensor:
    """Run the named estimator. Returns (B, L) advantages; masked and invalid tokens are exactly 0."""
    spec = get_estimator(name)
    bad = sorted(set(options) - set(spec.options))
    if bad:
        raise TypeError(
            f"advantage estimator {name!r} got unknown option(s) {bad}; it accepts: {list(spec.options) or 'none'}"
        )
    inputs.require(name, *spec.requires)
    return spec.fn(inputs, **options)
