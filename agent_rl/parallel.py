"""Data-parallel mechanics for the learner: which rows a rank holds, gradient and count all-reduces,
and one way to combine micro-batch metrics across micro-batches and ranks.

Why apart from learner.py: the single-process learner reads as score -> advantages -> update; the
only data-parallel hook is `Learner.update(batch, shard=...)`, and everything it needs from
torch.distributed lives here. Without a shard nothing here touches torch.distributed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shard:
    """The rows of the global batch that one data-parallel learner rank holds.

    Why the global row numbers: every rank draws the same permutation of all `total` rows (their
    generators are in the same state) and keeps its own rows of each minibatch, so the minibatches
    are exactly those of one process updating on the whole batch.
    """

    rows: torch.Tensor
    """(b,) long: global indices of this rank's rows, in the order they appear in its batch."""
    total: int
    """Rows in the global batch."""
    lockstep: bool = False
    """The model is sharded (FSDP): every forward/backward is a collective, so all ranks must run
    the same number of them (see `lockstep`), and FSDP itself sums the gradients (no `sum_gradients`)."""

    def local(self, global_idx: torch.Tensor) -> torch.Tensor:
        """Positions in this rank's batch of the `global_idx` rows it holds (order kept, others dropped)."""
        position = torch.full((self.total,), -1, dtype=torch.long)
        position[self.rows] = torch.arange(len(self.rows))
        local = position[global_idx]
        return local[local >= 0]


def all_reduce_sum(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Sum `t` over the ranks (on `device`: NCCL only reduces CUDA tensors); returned on t's device."""
    import torch.distributed as dist

    buf = t.to(device, copy=True)
    dist.all_reduce(buf)
    return buf.to(t.device)


def sum_gradients(params: list[torch.nn.Parameter]) -> None:
    """All-reduce (SUM) the accumulated gradients over the ranks: one flat buffer per dtype.

    A rank that held no row of a minibatch contributes zeros; a parameter that no rank produced a
    gradient for keeps `grad=None`, as in one process (AdamW skips it instead of decaying it).
    """
    import torch.distributed as dist

    device = params[0].device
    had = torch.tensor([float(p.grad is not None) for p in params], device=device)
    dist.all_reduce(had)
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = defaultdict(list)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype[p.grad.dtype].append(p)
    for group in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in group])  # type: ignore[union-attr]
        dist.all_reduce(flat)
        for p, g in zip(group, flat.split([p.numel() for p in group])):
            p.grad.copy_(g.view_as(p))  # type: ignore[union-attr]
    for p, n in zip(params, had.tolist()):
        if n == 0:
            p.grad = None


def lockstep(micro_batches: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    """This rank's non-empty micro-batches padded with None up to the most any rank has.

    Why: under FSDP each forward all-gathers and each backward reduce-scatters, so a rank that ran
    fewer passes than another would leave it waiting forever in a collective. A None is a pass
    that contributes an exactly-zero gradient (`Learner.update` runs it on a real row, loss x 0).
    """
    own = [idx for idx in micro_batches if len(idx)]
    most = all_reduce_max(torch.tensor(float(len(own))), device)
    return [*own, *[None] * (int(most) - len(own))]


def all_reduce_max(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Max of `t` over the ranks (on `device`), returned on t's device."""
    import torch.distributed as dist

    buf = t.to(device, copy=True)
    dist.all_reduce(buf, op=dist.ReduceOp.MAX)
    return buf.to(t.device)


SUMMED = frozenset({"losses/loss", "losses/pg_loss", "losses/kl_ref", "losses/entropy", "losses/n_tokens"})
"""Micro-batch metrics that are parts of a sum: the loss terms are already divided by the minibatch's
(global) count, so a minibatch's value is the sum over its micro-batches (as is its token count)."""
EXTREMES = {"losses/ratio_max": max, "losses/ratio_min": min}
"""Every other losses/ metric is a token mean of its micro-batch: combined weighted by tokens."""


def combine_micro_metrics(records: Sequence[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """Per optimiser step, one value per metric from its micro-batches (on one rank or many): sums
    for SUMMED, max/min for EXTREMES, token-weighted means for the rest; then the mean over steps.
    So the logged loss is the minibatch's loss however it was split into micro-batches or ranks."""
    by_step: dict[int, list[dict[str, float]]] = defaultdict(list)
    for step, record in records:
        by_step[step].append(record)
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for step in sorted(by_step):
        step_records = by_step[step]
        for key in dict.fromkeys(k for r in step_records for k in r):
            values = [(r[key], r["losses/n_tokens"]) for r in step_records if key in r]
            if key in SUMMED:
                value = sum(v for v, _ in values)
            elif key in EXTREMES:
                with_tokens = [v for v, n in values if n > 0] or [v for v, _ in values]
                value = EXTREMES[key](with_tokens)
            else:
                tokens = sum(n for _, n in values)
                value = sum(v * n for v, n in values) / tokens if tokens else 0.0
            sums[key] += value
            counts[key] += 1
    return {k: sums[k] / counts[k] for k in sums}
