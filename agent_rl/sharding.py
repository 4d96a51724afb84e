"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for the learner ranks: shard, gather, load.

Why a module of its own: the data-parallel learner (agent_rl/parallel.py, `Learner.update` with a
`Shard`) keeps a full replica per rank; with `scale.learner_sharding: fsdp` each rank instead keeps
1/world of every parameter, gradient and AdamW moment (DTensors sharded on dim 0), and the full
weights exist only transiently, one decoder layer at a time, inside forward and backward. What
that changes for the callers, and what lives here:

- each decoder layer is one unit; the embedding, final norm and LM head are the root unit of a
  `ShardedLM` wrapper, because the learner calls the backbone and the head separately;
- every forward/backward all-gathers parameters and every backward reduce-scatters gradients, so
  all ranks must run the SAME number of passes (`Learner.update` pads a rank that has fewer
  micro-batches with zero-loss passes, see `parallel.lockstep`);
- scoring (no-grad forwards over a rank's own, differently sized shard) runs inside `gathered`,
  which all-gathers every parameter once on all ranks and keeps them gathered, so the rank's
  forwards issue no collective at all;
- weights for the rollout engine and checkpoints are gathered to full tensors (`full_state`):
  a collective, so every rank calls it; the result is the in-process format (parameter names and
  AdamW's index-keyed state), so a checkpoint resumes with any number of ranks, sharded or not.

Gradients are SUMMED over ranks (`set_gradient_divide_factor(1)`): the loss is already divided by
the global token/sequence count, exactly as in the replicated path.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ShardingSpec:
    """How a rank shards its model (plain data: pickled to Ray actors)."""

    param_dtype: str | None = None
    """Compute dtype of the gathered weights ('bfloat16' = bf16 mixed precision, gradients reduced
    in float32 and kept in the parameters' float32); None = the model's own dtype, no casting."""


def _layers(decoder: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks to shard one by one (HF decoders keep them in `.layers`)."""
    for name in ("layers", "h", "blocks"):
        node = getattr(decoder, name, None)
        if isinstance(node, torch.nn.ModuleList):
            return list(node)
    return []


class ShardedLM(torch.nn.Module):
    """The FSDP root around a HF causal LM: what the learner trains when the ranks shard.

    Why a wrapper: the learner's log-prob pass (`logprobs.causal_lm_token_stats`) calls
    `model.get_decoder()(...)` and then reads `model.get_output_embeddings().weight` itself; it never
    calls the causal LM's own forward. FSDP gathers a unit's parameters in that unit's forward, so a
    unit on the LM would never gather its embedding, final norm and head. Here `get_decoder()` is
    the wrapper itself, whose forward runs the backbone: the root unit (embedding, norm, head, tied
    or not) is gathered there, and as the root it stays gathered until the backward, so the head's
    weight read after the backbone returns is the full tensor. Parameter names and the state dict
    stay the LM's (`lm`); checkpoints use `lm.state_dict()`.
    """

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm
        self.config = getattr(lm, "config", None)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.lm.get_decoder()(*args, **kwargs)

    def get_decoder(self) -> torch.nn.Module:
        return self

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm.get_output_embeddings()

    @property
    def supports_gradient_checkpointing(self) -> bool:
        return bool(getattr(self.lm, "supports_gradient_checkpointing", False))

    def gradient_checkpointing_enable(self, **kwargs: Any) -> None:
        self.lm.gradient_checkpointing_enable(**kwargs)


def shard_model(model: torch.nn.Module, spec: ShardingSpec = ShardingSpec()) -> ShardedLM:
    """`fully_shard` each decoder layer, then the rest (embedding, final norm, LM head) as the root
    unit of a `ShardedLM` around `model`; the LM's parameters are replaced by DTensor shards in place.

    Needs an initialised default process group; every rank must call it with the same model.
    Per-layer units bound the transient full weights to one layer (plus the root's) at a time.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy()
    if spec.param_dtype is not None:
        mp = MixedPrecisionPolicy(param_dtype=getattr(torch, spec.param_dtype), reduce_dtype=torch.float32)
    for layer in _layers(model.get_decoder()):
        fully_shard(layer, mp_policy=mp)
    root = ShardedLM(model)
    # Explicitly never resharded after its forward (what FSDP does for a root anyway once it has
    # run): the head's weight is read after the backbone returns; `gathered` restores this value.
    fully_shard(root, mp_policy=mp, reshard_after_forward=False)
    for module in fsdp_modules(root):
        module.set_gradient_divide_factor(1.0)  # sum: the loss is already divided by the global count
        # A plain SUM collective (gloo has no PREMUL_SUM, which a custom factor would otherwise use).
        module.set_force_sum_reduction_for_comms(True)
    return root


def fsdp_modules(model: torch.nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model: torch.nn.Module) -> bool:
    return bool(fsdp_modules(model))


@contextmanager
def gathered(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """All-gather every parameter once (a collective: all ranks enter together) and keep it
    gathered until exit, so the forwards inside issue no collective and ranks may run any number
    of them (a rank scores its own shard). For no-grad use: a backward inside would reduce-scatter."""
    modules = fsdp_modules(model)
    # Restored on exit: the outer unit must keep NOT resharding after its forward, because the
    # head's weight is read after the backbone's forward returns (see `shard_model`).
    before = [m._get_fsdp_state()._fsdp_param_group._reshard_after_forward for m in modules]
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield model
    finally:
        for m, value in zip(modules, before):
            m.reshard()
            m.set_reshard_after_forward(value, recurse=False)


def full_value(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _local_like(like: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `full` laid out as `like` (a DTensor), cut locally: every rank holds
    the same full tensor, so no communication is needed."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(like, DTensor):
        return full.to(like.device, like.dtype)
    full = full.to(like.to_local().device, like.dtype)
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    """`t`'s full value as a CPU tensor with memory of its own (a collective for a DTensor).

    Why a copy where `.to("cpu")` would hand back `t` itself (a plain CPU tensor, such as AdamW's
    `step` counter): a state dict must keep the value it had when taken. AdamW increments `step` in
    place, so a checkpoint holding the live counter, kept in memory before being written, reads a
    later count (an earlier FSDP resume check loaded counters of 24 after 8 optimiser steps).
    """
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    out = full_value(t).detach().to("cpu")
    shared = out.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
    return out.clone() if shared else out


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict as plain CPU tensors (a collective: call it on every rank)."""
    return {k: _snapshot(v) for k, v in model.state_dict().items()}


def load_full_model_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load a plain (unsharded) state dict into a sharded model; every rank passes the same one."""
    own = model.state_dict()
    missing, unexpected = set(own) - set(state), set(state) - set(own)
    if missing or unexpected:
        raise KeyError(
            f"state dict does not match the model: missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}"
        )
    with torch.no_grad():
        for name, value in own.items():
            value.copy_(_local_like(value, state[name]))


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`optimizer.state_dict()` with every sharded moment gathered (a collective): the format of an
    unsharded optimizer over the same parameters in the same order. Every tensor is a copy (see
    `_snapshot`), so the result does not change as the optimizer keeps stepping."""
    state = optimizer.state_dict()
    state["state"] = {
        i: {k: _snapshot(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for i, s in state["state"].items()
    }
    return state


def load_full_optimizer_state(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """The inverse of `full_optimizer_state`: each rank keeps its shard of every moment (cut
    locally, no collective), and every tensor the optimizer keeps is a copy of its own.

    Why copies: `Optimizer.load_state_dict` keeps the given `step` tensors as they are (and moments
    already of the parameter's device and dtype, as `_local_like`'s cut is: a view into the full
    tensor), and AdamW then updates them in place, inside the caller's checkpoint, which ranks may
    share. Ranks spawned by torch.multiprocessing do (tensor arguments move to shared memory): two
    ranks each added 1 to one counter per optimiser step, so the resumed ranks' bias correction
    ran ahead (7.6e-3 relative L2 from the uninterrupted ranks after two RL steps).
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def owned(param: torch.Tensor, key: str, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if key != "step" and value.shape == param.shape:  # a moment: this rank's shard of it
            return _local_like(param, value).clone()
        return value.detach().clone()

    sharded = {i: {k: owned(params[int(i)], k, v) for k, v in s.items()} for i, s in state["state"].items()}
    optimizer.load_state_dict({**state, "state": sharded})


def local_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimiser state (local shards only)."""

    def size(t: Any) -> int:
        from torch.distributed.tensor import DTensor

        if not isinstance(t, torch.Tensor):
            return 0
        local = t.to_local() if isinstance(t, DTensor) else t
        return local.numel() * local.element_size()

    params = list(model.parameters())
    out = {
        "params": sum(size(p) for p in params),
        "grads": sum(size(p.grad) for p in params if p.grad is not None),
        "optimizer": 0,
    }
    if optimizer is not None:
        out["optimizer"] = sum(size(v) for s in optimizer.state.values() for v in s.values())
    return out
