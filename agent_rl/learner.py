"""One policy update from one collated rollout batch.

The learner knows nothing about environments or engines: it takes the tensors `collate` made,
scores them with the current policy (log-probs, entropy and the OTB collision term sum p^2 in one
chunked forward pass), computes advantages by estimator name, and runs PPO-clip minibatch updates
with gradient accumulation: RolloutBatch -> (score, advantages) -> ScoredBatch -> update. That keeps
it movable to another process: batch in, metrics and weights out. Data-parallel ranks
(agent_rl/distributed/learner.py) run the same code on a shard of the batch; the only hook is
`update(batch, shard=...)`, whose mechanics live in agent_rl/parallel.py.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from agent_rl.advantages import (
    AdvantageInputs,
    advantage_metrics,
    compute_advantages,
    logit_gradient_proxy,
    required_inputs,
)
from agent_rl.batch import PolicyScores, RolloutBatch, ScoredBatch
from agent_rl.config import AlgoConfig, TrainConfig
from agent_rl.logprobs import TokenStats, causal_lm_token_stats
from agent_rl.lora import load_policy_state, policy_state
from agent_rl.loss import PPOLossConfig, ppo_loss
from agent_rl.offpolicy import ISCorrection, importance_weights, mismatch_metrics
from agent_rl.overlong import OverlongConfig, overlong_loss_mask, shape_overlong_rewards
from agent_rl.packing import packed_token_stats
from agent_rl.parallel import Shard, all_reduce_sum, combine_micro_metrics, lockstep, sum_gradients


def step_metrics(scored: ScoredBatch) -> dict[str, float]:
    """Advantage and policy statistics of a scored batch (over the whole batch, also with ranks)."""
    policy, scores = scored.policy_mask, scored.scores
    metrics = advantage_metrics(scored.advantages, policy)
    if policy.any():
        w = logit_gradient_proxy(scores.trainer_log_probs, scores.sum_pi_squared, policy)  # (B, R)
        drift = (scored.rollout.sampler_log_probs - scores.trainer_log_probs).abs()  # (B, R)
        metrics["policy/entropy"] = float(scores.entropy[policy].mean())
        metrics["policy/proxy_w_mean"] = float(w[policy].mean())
        metrics["policy/sampler_trainer_logp_diff"] = float(drift[policy].max())
        metrics.update(
            mismatch_metrics(
                scores.trainer_log_probs, scored.rollout.sampler_log_probs, policy, scored.is_weights
            )
        )
    if scored.loss_weights is not None and policy.any():
        metrics["train/loss_weight_zero_frac"] = float((scored.loss_weights[policy] == 0).float().mean())
    return metrics


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Turn on HF gradient checkpointing (active only in train mode, i.e. in `Learner.update`; the
    no-grad scoring pass and the engine's generation are unaffected)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"{type(model).__name__} does not support gradient checkpointing; set train.activation_checkpointing=false"
        )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _scalar(norm: torch.Tensor) -> float:
    """A gradient norm as a float; under FSDP it is a DTensor (already reduced over the ranks)."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


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
        if train.activation_checkpointing:
            enable_activation_checkpointing(model)
        trainable = [p for p in model.parameters() if p.requires_grad]  # only the adapters under LoRA
        self.optimizer = torch.optim.AdamW(trainable, lr=train.lr, weight_decay=train.weight_decay)
        warm = max(1, train.warmup_lr_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warm))
        self.loss_config = PPOLossConfig(
            clip_ratio_low=algo.clip_eps,
            clip_ratio_high=algo.clip_eps if algo.clip_eps_high is None else algo.clip_eps_high,
            dual_clip=algo.dual_clip,
            loss_agg_mode=algo.loss_agg,
            kl_coef=algo.kl_coef,
            entropy_coef=algo.entropy_coef,
        )
        # 'auto' is resolved by Config validation (by engine); a bare AlgoConfig's auto means off.
        mode = "off" if algo.is_correction == "auto" else algo.is_correction
        self.is_correction = ISCorrection(mode=mode, cap=algo.is_cap, band=algo.is_band)
        self.overlong = OverlongConfig(
            mode=algo.overlong,
            penalty=algo.overlong_penalty,
            buffer=algo.overlong_buffer,
            max_tokens=algo.overlong_max_tokens,
        )
        self.generator = torch.Generator().manual_seed(train.seed)
        self.micro_metrics: list[tuple[int, dict[str, float]]] = []
        """(optimiser step, losses/ metrics) of every micro-batch of the last update: data-parallel
        ranks are reduced from these, since a rank's means alone cannot be combined exactly."""

    # -- scoring -------------------------------------------------------------------------------
    def _stats(
        self, model: torch.nn.Module, batch: RolloutBatch, *, entropy: bool, sum_p2: bool
    ) -> TokenStats:
        if self.algo.pack_tokens is not None:  # the rows end to end, not padded (agent_rl/packing.py)
            return packed_token_stats(
                model,
                batch.input_ids,
                batch.attention_mask,
                response_length=batch.response_length,
                budget=self.algo.pack_tokens,
                position_ids=batch.position_ids,
                temperature=self.temperature,
                with_entropy=entropy,
                with_sum_pi_squared=sum_p2,
            )
        return causal_lm_token_stats(
            model,
            batch.input_ids,
            batch.attention_mask,
            response_length=batch.response_length,
            position_ids=batch.position_ids,
            temperature=self.temperature,
            with_entropy=entropy,
            with_sum_pi_squared=sum_p2,
        )

    @torch.no_grad()
    def score(self, batch: RolloutBatch) -> PolicyScores:
        """The current policy's log-probs, sum p^2 and entropy per token (and the reference's log-probs).

        The learner scores with its own forward pass rather than trusting the sampler's log-probs,
        so that the PPO ratio starts at exactly 1 even when the engine differs from the trainer.
        """
        self.model.eval()
        parts: dict[str, list[torch.Tensor]] = {"lp": [], "p2": [], "ent": [], "ref": []}
        for idx in self._micro_batches(len(batch), shuffle=False):
            micro = batch.rows(idx)
            stats = self._stats(self.model, micro, entropy=True, sum_p2=True)
            parts["lp"].append(stats.log_probs)
            parts["p2"].append(stats.sum_pi_squared)
            parts["ent"].append(stats.entropy)
            if self.ref_model is not None:
                parts["ref"].append(self._stats(self.ref_model, micro, entropy=False, sum_p2=False).log_probs)
        return PolicyScores(
            trainer_log_probs=torch.cat(parts["lp"]),
            sum_pi_squared=torch.cat(parts["p2"]),
            entropy=torch.cat(parts["ent"]),
            ref_log_probs=torch.cat(parts["ref"]) if parts["ref"] else None,
        )

    def _row_log_probs(self, batch: RolloutBatch) -> list[torch.Tensor]:
        """Differentiable (R,) log-probs per row, one forward each, for per-sample backward passes:
        each backward then walks one row's graph instead of the whole batch's (O(B), not O(B^2))."""
        return [
            self._stats(self.model, batch.rows(torch.tensor([i])), entropy=False, sum_p2=False).log_probs[0]
            for i in range(len(batch))
        ]

    def exact_sequence_grad_sq_norms(self, batch: RolloutBatch) -> torch.Tensor:
        """(B,) true ||grad log p(response_i)||^2 by per-sample backward passes (small models only)."""
        from agent_rl.grad_stats import per_sample_grad_sq_norms

        params = [p for p in self.model.parameters() if p.requires_grad]
        objectives = [lp[m].sum() for lp, m in zip(self._row_log_probs(batch), batch.policy_mask)]
        return per_sample_grad_sq_norms(objectives, params)

    def gradient_diagnostics(self, scored: ScoredBatch) -> dict[str, float]:
        """Exact per-sample policy-gradient variance and proxy-vs-true rank correlation (small models)."""
        from agent_rl.grad_stats import exact_gradient_diagnostics

        params = [p for p in self.model.parameters() if p.requires_grad]
        diag = exact_gradient_diagnostics(
            self._row_log_probs(scored.rollout),
            scored.advantages,
            scored.policy_mask,
            scored.scores.sum_pi_squared,  # scored by this same policy just before
            params,
        )
        self.model.zero_grad(set_to_none=True)
        return diag.metrics()

    def advantages(
        self,
        batch: RolloutBatch,
        scores: PolicyScores,
        grad_sq_norms: torch.Tensor | None = None,
        is_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        inputs = AdvantageInputs(
            token_rewards=batch.token_rewards,
            response_mask=batch.response_mask,
            group_index=batch.group_index,
            old_log_probs=scores.trainer_log_probs,
            sum_pi_squared=scores.sum_pi_squared,
            grad_sq_norms=grad_sq_norms,
            is_weights=is_weights,
            valid=batch.valid,
        )
        return compute_advantages(self.algo.estimator, inputs, **self.algo.estimator_options)

    def needs(self, name: str) -> bool:
        """Whether the configured estimator needs an optional input (e.g. grad_sq_norms)."""
        return name in required_inputs(self.algo.estimator)

    # -- update --------------------------------------------------------------------------------
    def _micro_batches(self, n: int, *, shuffle: bool) -> list[torch.Tensor]:
        order = torch.randperm(n, generator=self.generator) if shuffle else torch.arange(n)
        return list(order.split(self.algo.micro_batch_size))

    def _denominator(self, batch: ScoredBatch, shard: Shard | None = None) -> torch.Tensor:
        """Tokens (token-mean) or sequences (seq-* modes) in the minibatch: over all ranks with a shard."""
        mask = batch.policy_mask
        count = mask.sum() if self.algo.loss_agg == "token-mean" else mask.any(1).sum()
        if shard is not None:
            count = all_reduce_sum(count, next(self.model.parameters()).device)
        return count.clamp_min(1).float()

    def _accumulate(self, micro: ScoredBatch, denominator: torch.Tensor) -> dict[str, float]:
        """Forward and backward of one micro-batch; its loss is divided by the minibatch's count."""
        stats = self._stats(self.model, micro.rollout, entropy=True, sum_p2=False)
        out = ppo_loss(
            stats.log_probs,
            micro.scores.trainer_log_probs,
            micro.advantages,
            micro.policy_mask,
            self.loss_config,
            ref_log_probs=micro.scores.ref_log_probs,
            entropy=stats.entropy,
            denominator=denominator,
            is_weights=micro.loss_weights,
        )
        out.loss.backward()
        return {k: float(v) for k, v in out.metrics.items()}

    def _idle_pass(self, batch: ScoredBatch) -> None:
        """A forward/backward that adds an exactly-zero gradient (loss x 0 on one real row): under
        FSDP it lets a rank with fewer micro-batches join the others' collectives (`lockstep`)."""
        stats = self._stats(self.model, batch.rows(torch.tensor([0])).rollout, entropy=False, sum_p2=False)
        (stats.log_probs.sum() * 0.0).backward()

    def update(self, batch: ScoredBatch, shard: Shard | None = None) -> dict[str, float]:
        """PPO epochs x minibatches, each an optimiser step accumulated over micro-batches.

        shard: on a data-parallel rank, `batch` holds only these rows of the global batch. The rank
        then walks the global minibatches, divides its loss by the global token/sequence count and
        sums gradients over the ranks before clipping, so each rank takes exactly the optimiser
        step of one process on the whole batch (up to float rounding).
        """
        self.micro_metrics = []
        n = len(batch) if shard is None else shard.total
        params = list(self.model.parameters())
        norms: list[float] = []
        self.model.train()
        for _ in range(self.algo.ppo_epochs):
            order = torch.randperm(n, generator=self.generator)
            for mb_idx in order.tensor_split(self.algo.minibatches):
                if shard is not None:
                    mb_idx = shard.local(mb_idx)
                minibatch = batch.rows(mb_idx)
                denominator = self._denominator(minibatch, shard)
                self.optimizer.zero_grad(set_to_none=True)
                micros: list[torch.Tensor | None] = list(self._micro_batches(len(mb_idx), shuffle=False))
                if shard is not None and shard.lockstep:  # FSDP: as many passes as every other rank
                    micros = lockstep(micros, denominator.device)  # type: ignore[arg-type]
                for idx in micros:
                    if idx is None:
                        self._idle_pass(batch)
                        continue
                    if len(idx) == 0:  # a minibatch with no rows here (a rank's share may be empty)
                        continue
                    record = self._accumulate(minibatch.rows(idx), denominator)
                    self.micro_metrics.append((len(norms), record))
                if shard is not None and not shard.lockstep:  # (FSDP reduce-scatters by itself)
                    sum_gradients([p for p in params if p.requires_grad])
                norms.append(_scalar(torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)))
                self.optimizer.step()
                self.scheduler.step()
        metrics = combine_micro_metrics(self.micro_metrics)
        metrics["grad/norm"] = statistics.fmean(norms)  # before clipping, mean over optimiser steps
        metrics["grad/max_norm"] = max(norms)
        metrics["perf/lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    def prepare(self, batch: RolloutBatch) -> ScoredBatch:
        """Score the batch with the current policy and add its advantages (everything before the update).

        Also where the sampler/trainer correction is formed (its weights feed both OTB's proxy, as
        rho^2, and the loss) and where overlong episodes are penalised or filtered.
        """
        batch = shape_overlong_rewards(batch, self.overlong)
        scores = self.score(batch)
        norms = self.exact_sequence_grad_sq_norms(batch) if self.needs("grad_sq_norms") else None
        corrected = importance_weights(
            scores.trainer_log_probs, batch.sampler_log_probs, batch.policy_mask, self.is_correction
        )
        is_weights = None if corrected is None else corrected.weights
        loss_weights = is_weights
        filtered = overlong_loss_mask(batch, self.overlong)
        if filtered is not None:
            loss_weights = filtered if loss_weights is None else loss_weights * filtered
        return ScoredBatch(
            batch,
            scores,
            self.advantages(batch, scores, norms, is_weights),
            grad_sq_norms=norms,
            is_weights=is_weights,
            loss_weights=loss_weights,
        )

    def step(self, batch: RolloutBatch, *, diagnose: bool = False) -> tuple[ScoredBatch, dict[str, float]]:
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
            "model": policy_state(self.model),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_policy_state(self.model, state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.generator.set_state(state["generator"])
