"""One policy update from one collated rollout batch.

The learner knows nothing about environments or engines: it takes the tensors `collate` made,
scores them with the current policy (log-probs, entropy and the OTB collision term sum p^2 in one
chunked forward pass), computes advantages by estimator name, and runs PPO-clip minibatch updates
with gradient accumulation. That keeps it movable to another process: batch in, metrics and
weights out. Data-parallel ranks (agent_rl/distributed/learner.py) run the same code on a shard of
the batch; the only hook is `update(batch, shard=...)`, which uses the global minibatches, the global
loss normaliser and gradients summed over ranks. Without a shard nothing touches torch.distributed.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agent_rl.advantages import (
    AdvantageInputs,
    advantage_metrics,
    compute_advantages,
    logit_gradient_proxy,
    required_inputs,
)
from agent_rl.config import AlgoConfig, TrainConfig
from agent_rl.logprobs import TokenStats, causal_lm_token_stats
from agent_rl.loss import PPOLossConfig, ppo_loss

Batch = dict[str, Any]


def _rows(batch: Batch, idx: torch.Tensor) -> Batch:
    return {k: v[idx] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in batch.items()}


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

    def local(self, global_idx: torch.Tensor) -> torch.Tensor:
        """Positions in this rank's batch of the `global_idx` rows it holds (order kept, others dropped)."""
        position = torch.full((self.total,), -1, dtype=torch.long)
        position[self.rows] = torch.arange(len(self.rows))
        local = position[global_idx]
        return local[local >= 0]


def _all_reduce_sum(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Sum `t` over the ranks (on `device`: NCCL only reduces CUDA tensors); returned on t's device."""
    import torch.distributed as dist

    buf = t.to(device, copy=True)
    dist.all_reduce(buf)
    return buf.to(t.device)


def _sum_gradients(params: list[torch.nn.Parameter]) -> None:
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


def step_metrics(scored: Batch) -> dict[str, float]:
    """Advantage and policy statistics of a scored batch (over the whole batch, also with ranks)."""
    policy = scored["response_mask"].bool() & scored["valid"][:, None]
    metrics = advantage_metrics(scored["advantages"], policy)
    if policy.any():
        w = logit_gradient_proxy(scored["old_log_probs"], scored["sum_pi_squared"], policy)  # (B, R)
        drift = (scored["sampler_log_probs"] - scored["old_log_probs"]).abs()  # (B, R)
        metrics["policy/entropy"] = float(scored["entropy"][policy].mean())
        metrics["policy/proxy_w_mean"] = float(w[policy].mean())
        metrics["policy/sampler_trainer_logp_diff"] = float(drift[policy].max())
    return metrics


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


class Learner:
    """Owns the optimiser and scheduler of `model`; `step(batch)` is one RL update."""

    def __init__(
        self,
        model: torch.nn.Module,
        algo: AlgoConfig,
        train: TrainConfig,
        *,
        temperature: float = 1.0,
        ref_model: torch.nn.Module | None = None,
    ) -> None:
        self.model = model
        self.algo = algo
        self.temperature = temperature
        self.ref_model = ref_model
        self.max_grad_norm = train.max_grad_norm
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=train.lr, weight_decay=train.weight_decay)
        warm = max(1, train.warmup_lr_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warm))
        self.loss_config = PPOLossConfig(
            clip_ratio_low=algo.clip_eps,
            clip_ratio_high=algo.clip_eps,
            dual_clip=algo.dual_clip,
            loss_agg_mode=algo.loss_agg,
            kl_coef=algo.kl_coef,
            entropy_coef=algo.entropy_coef,
        )
        self.generator = torch.Generator().manual_seed(train.seed)
        self.micro_metrics: list[tuple[int, dict[str, float]]] = []
        """(optimiser step, losses/ metrics) of every micro-batch of the last update: data-parallel
        ranks are reduced from these, since a rank's means alone cannot be combined exactly."""

    # -- scoring -------------------------------------------------------------------------------
    def _stats(self, model: torch.nn.Module, batch: Batch, *, entropy: bool, sum_p2: bool) -> TokenStats:
        return causal_lm_token_stats(
            model,
            batch["input_ids"],
            batch["attention_mask"],
            response_length=batch["response_mask"].shape[1],
            position_ids=batch["position_ids"],
            temperature=self.temperature,
            with_entropy=entropy,
            with_sum_pi_squared=sum_p2,
        )

    @torch.no_grad()
    def score(self, batch: Batch) -> Batch:
        """Add old_log_probs (trainer's, before the update), sum_pi_squared and entropy per token.

        The sampler's log-probs stay in `sampler_log_probs`; the learner scores with its own
        forward pass so that the PPO ratio starts at exactly 1 even when the engine differs.
        """
        self.model.eval()
        out = {"old_log_probs": [], "sum_pi_squared": [], "entropy": [], "ref_log_probs": []}
        for idx in self._micro_batches(len(batch["input_ids"]), shuffle=False):
            micro = _rows(batch, idx)
            stats = self._stats(self.model, micro, entropy=True, sum_p2=True)
            out["old_log_probs"].append(stats.log_probs)
            out["sum_pi_squared"].append(stats.sum_pi_squared)
            out["entropy"].append(stats.entropy)
            if self.ref_model is not None:
                out["ref_log_probs"].append(
                    self._stats(self.ref_model, micro, entropy=False, sum_p2=False).log_probs
                )
        scored = dict(batch, sampler_log_probs=batch["old_log_probs"])
        scored.update({k: torch.cat(v) for k, v in out.items() if v})
        return scored

    def _row_log_probs(self, batch: Batch) -> list[torch.Tensor]:
        """Differentiable (R,) log-probs per row, one forward each, for per-sample backward passes:
        each backward then walks one row's graph instead of the whole batch's (O(B), not O(B^2))."""
        return [
            self._stats(self.model, _rows(batch, torch.tensor([i])), entropy=False, sum_p2=False).log_probs[0]
            for i in range(len(batch["input_ids"]))
        ]

    def exact_sequence_grad_sq_norms(self, batch: Batch) -> torch.Tensor:
        """(B,) true ||grad log p(response_i)||^2 by per-sample backward passes (small models only)."""
        from agent_rl.grad_stats import per_sample_grad_sq_norms

        params = [p for p in self.model.parameters() if p.requires_grad]
        mask = batch["response_mask"].bool() & batch["valid"][:, None]
        objectives = [lp[m].sum() for lp, m in zip(self._row_log_probs(batch), mask)]
        return per_sample_grad_sq_norms(objectives, params)

    def gradient_diagnostics(self, scored: Batch) -> dict[str, float]:
        """Exact per-sample policy-gradient variance and proxy-vs-true rank correlation (small models)."""
        from agent_rl.grad_stats import exact_gradient_diagnostics

        params = [p for p in self.model.parameters() if p.requires_grad]
        diag = exact_gradient_diagnostics(
            self._row_log_probs(scored),
            scored["advantages"],
            scored["response_mask"],
            scored["sum_pi_squared"],  # scored by this same policy just before
            params,
            valid=scored["valid"],
        )
        self.model.zero_grad(set_to_none=True)
        return diag.metrics()

    def advantages(self, batch: Batch) -> torch.Tensor:
        inputs = AdvantageInputs(
            token_rewards=batch["token_rewards"],
            response_mask=batch["response_mask"],
            group_index=batch["group_index"],
            old_log_probs=batch["old_log_probs"],
            sum_pi_squared=batch["sum_pi_squared"],
            grad_sq_norms=batch.get("grad_sq_norms"),
            valid=batch["valid"],
        )
        return compute_advantages(self.algo.estimator, inputs, **self.algo.estimator_options)

    def needs(self, name: str) -> bool:
        """Whether the configured estimator needs an optional input (e.g. grad_sq_norms)."""
        return name in required_inputs(self.algo.estimator)

    # -- update --------------------------------------------------------------------------------
    def _micro_batches(self, n: int, *, shuffle: bool) -> list[torch.Tensor]:
        order = torch.randperm(n, generator=self.generator) if shuffle else torch.arange(n)
        return list(order.split(self.algo.micro_batch_size))

    def _denominator(self, batch: Batch, shard: Shard | None = None) -> torch.Tensor:
        """Tokens (token-mean) or sequences (seq-* modes) in the minibatch: over all ranks with a shard."""
        mask = batch["response_mask"].bool() & batch["valid"][:, None]
        count = mask.sum() if self.algo.loss_agg == "token-mean" else mask.any(1).sum()
        if shard is not None:
            count = _all_reduce_sum(count, next(self.model.parameters()).device)
        return count.clamp_min(1).float()

    def update(self, batch: Batch, shard: Shard | None = None) -> dict[str, float]:
        """PPO epochs x minibatches, each an optimiser step accumulated over micro-batches.

        shard: on a data-parallel rank, `batch` holds only these rows of the global batch. The rank
        then walks the global minibatches, divides its loss by the global token/sequence count and
        sums gradients over the ranks before clipping, so each rank takes exactly the optimiser
        step of one process on the whole batch (up to float rounding).
        """
        self.micro_metrics = []
        n = len(batch["input_ids"]) if shard is None else shard.total
        params = list(self.model.parameters())
        norms: list[float] = []
        opt_step = 0
        self.model.train()
        for _ in range(self.algo.ppo_epochs):
            order = torch.randperm(n, generator=self.generator)
            for mb_idx in order.tensor_split(self.algo.minibatches):
                if shard is not None:
                    mb_idx = shard.local(mb_idx)
                minibatch = _rows(batch, mb_idx)
                denominator = self._denominator(minibatch, shard)
                self.optimizer.zero_grad(set_to_none=True)
                for idx in self._micro_batches(len(mb_idx), shuffle=False):
                    if len(idx) == 0:  # a minibatch with no rows here (a rank's share may be empty)
                        continue
                    micro = _rows(minibatch, idx)
                    stats = self._stats(self.model, micro, entropy=True, sum_p2=False)
                    out = ppo_loss(
                        stats.log_probs,
                        micro["old_log_probs"],
                        micro["advantages"],
                        micro["response_mask"],
                        self.loss_config,
                        valid=micro["valid"],
                        ref_log_probs=micro.get("ref_log_probs"),
                        entropy=stats.entropy,
                        denominator=denominator,
                    )
                    out.loss.backward()
                    self.micro_metrics.append((opt_step, {k: float(v) for k, v in out.metrics.items()}))
                if shard is not None:
                    _sum_gradients([p for p in params if p.requires_grad])
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm))
                norms.append(grad_norm)
                self.optimizer.step()
                self.scheduler.step()
                opt_step += 1
        metrics = combine_micro_metrics(self.micro_metrics)
        metrics["grad/norm"] = statistics.fmean(norms)  # before clipping, mean over optimiser steps
        metrics["grad/max_norm"] = max(norms)
        metrics["perf/lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    def prepare(self, batch: Batch) -> Batch:
        """Score the batch with the current policy and add its advantages (everything before the update)."""
        scored = self.score(batch)
        if self.needs("grad_sq_norms"):
            scored["grad_sq_norms"] = self.exact_sequence_grad_sq_norms(scored)
        scored["advantages"] = self.advantages(scored)
        return scored

    def step(self, batch: Batch, *, diagnose: bool = False) -> tuple[Batch, dict[str, float]]:
        """Score, estimate advantages, update. Returns the scored batch (with advantages) and metrics.

        diagnose: also measure the exact per-sample gradient variance before the update.
        """
        scored = self.prepare(batch)
        metrics = step_metrics(scored)
        if diagnose:
            metrics.update(self.gradient_diagnostics(scored))
        metrics.update(self.update(scored))
        return scored, metrics

    # -- checkpointing -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.generator.set_state(state["generator"])
