"""PPO-clip loss: hand-computed clipping, dual clip, aggregation modes, masking, KL, entropy, accumulation.

Tolerances. Everything is float32. Hand-computed one-token losses: r = exp(float32(log r)) carries
about (|log r| + 1) ulp (2^-24 ~ 6e-8 relative) and -A r one more, so rel 1e-6 (~17 ulp) leaves >= 5x
for r <= 5 (measured <= 4e-8 relative under AVX2 and AVX-512). Where no tolerance is given: two
computations of the same masked mean differ by re-association of <= 42 terms (~42 x 2^-24 ~ 2.5e-6
relative of values <= ~1), inside torch's float32 default (rtol 1.3e-6 plus atol 1e-5), and
pytest.approx's default rel 1e-6 is ~17 ulp for a few float32 ops.
"""

from __future__ import annotations

import math

import pytest
import torch

from agent_rl.loss import PPOLossConfig, aggregate, kl_penalty, ppo_loss


def one_token(ratio: float, advantage: float, config: PPOLossConfig = PPOLossConfig()):
    log_probs = torch.tensor([[math.log(ratio)]], requires_grad=True)
    out = ppo_loss(log_probs, torch.zeros(1, 1), torch.tensor([[advantage]]), torch.ones(1, 1), config)
    (grad,) = torch.autograd.grad(out.loss, log_probs)
    return out, float(grad)


@pytest.mark.parametrize(
    ("ratio", "advantage", "loss", "grad_zero", "clipped"),
    [
        (1.1, 2.0, -2.2, False, False),  # inside the trust region: -A r
        (1.5, 2.0, -2.4, True, True),  # A > 0, r above 1 + eps: clipped at 1.2, no gradient
        (0.5, 2.0, -1.0, False, True),  # A > 0, r below 1 - eps: pessimistic min keeps -A r
        (0.5, -2.0, 1.6, True, True),  # A < 0, r below 1 - eps: clipped at 0.8
        (1.5, -2.0, 3.0, False, True),  # A < 0, r above: unclipped -A r is the max
    ],
)
def test_clip_hand_computed(ratio, advantage, loss, grad_zero, clipped):
    out, grad = one_token(ratio, advantage)
    assert float(out.loss.detach()) == pytest.approx(loss, rel=1e-6)  # float32 log/exp round trip
    assert (grad == 0.0) == grad_zero
    assert float(out.metrics["losses/clipfrac"]) == float(clipped)


def test_dual_clip_caps_negative_advantage_loss():
    out, grad = one_token(5.0, -2.0)
    assert float(out.loss.detach()) == pytest.approx(10.0, rel=1e-6)  # ~(log 5 + 2) ulp of 10: ~2e-6
    out, grad = one_token(5.0, -2.0, PPOLossConfig(dual_clip=3.0))
    assert float(out.loss.detach()) == pytest.approx(6.0, rel=1e-6)  # -A * c = 2 * 3
    assert grad == 0.0
    assert float(out.metrics["losses/dual_clipfrac"]) == 1.0
    out, _ = one_token(5.0, 2.0, PPOLossConfig(dual_clip=3.0))  # positive advantages are unaffected
    assert float(out.loss.detach()) == pytest.approx(-2.4, rel=1e-6)


def test_asymmetric_clip_higher():
    out, _ = one_token(1.25, 1.0, PPOLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28))
    assert float(out.loss.detach()) == pytest.approx(-1.25, rel=1e-6)
    assert float(out.metrics["losses/clipfrac"]) == 0.0


def test_aggregation_modes_hand_computed():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])  # small integers: every mean below is exact
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]]).bool()
    assert float(aggregate(values, mask, "token-mean")) == pytest.approx(10 / 4)
    assert float(aggregate(values, mask, "seq-mean-token-sum")) == pytest.approx((6 + 4) / 2)
    assert float(aggregate(values, mask, "seq-mean-token-mean")) == pytest.approx((2 + 4) / 2)
    assert float(aggregate(values, torch.zeros_like(mask), "token-mean")) == 0.0
    with pytest.raises(ValueError, match="choose one of"):
        aggregate(values, mask, "sum")


def random_batch(seed=0, B=5, L=7):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, L, generator=gen) * 3
    log_probs = (old + torch.randn(B, L, generator=gen) * 0.3).requires_grad_()
    advantages = torch.randn(B, L, generator=gen)
    mask = torch.ones(B, L)
    for i, n in enumerate(torch.randint(1, L + 1, (B,), generator=gen).tolist()):
        mask[i, n:] = 0
    mask[0, 2] = 0  # a tool span inside the response
    ref = old + torch.randn(B, L, generator=gen) * 0.2
    entropy = torch.rand(B, L, generator=gen).requires_grad_()
    return log_probs, old, advantages, mask, ref, entropy


FULL = PPOLossConfig(dual_clip=3.0, kl_coef=0.1, entropy_coef=0.01)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_masked_tokens_contribute_exactly_zero_even_with_garbage(mode):
    log_probs, old, adv, mask, ref, entropy = random_batch()
    config = PPOLossConfig(dual_clip=3.0, kl_coef=0.1, entropy_coef=0.01, loss_agg_mode=mode)
    off = mask == 0
    clean = ppo_loss(log_probs, old, adv, mask, config, ref_log_probs=ref, entropy=entropy)
    garbage_lp = torch.where(off, torch.full_like(old, float("inf")), log_probs.detach()).requires_grad_()
    dirty = ppo_loss(
        garbage_lp,
        torch.where(off, torch.full_like(old, float("nan")), old),
        torch.where(off, torch.full_like(adv, 1e30), adv),
        mask,
        config,
        ref_log_probs=torch.where(off, torch.full_like(ref, -float("inf")), ref),
        entropy=entropy,
    )
    assert torch.isfinite(dirty.loss)
    torch.testing.assert_close(dirty.loss, clean.loss.detach())  # same values on-mask: float32 default
    (grad,) = torch.autograd.grad(dirty.loss, garbage_lp)
    assert grad[off].eq(0).all() and torch.isfinite(grad).all()
    for key, value in dirty.metrics.items():
        assert torch.isfinite(value), key


def test_invalid_sequences_are_excluded():
    log_probs, old, adv, mask, ref, entropy = random_batch(1)
    valid = torch.tensor([True, False, True, True, False])
    out = ppo_loss(log_probs, old, adv, mask, FULL, valid=valid, ref_log_probs=ref, entropy=entropy)
    keep = valid.nonzero().squeeze(1)
    sub = ppo_loss(
        log_probs[keep],
        old[keep],
        adv[keep],
        mask[keep],
        FULL,
        ref_log_probs=ref[keep],
        entropy=entropy[keep],
    )
    torch.testing.assert_close(out.loss, sub.loss)
    (grad,) = torch.autograd.grad(out.loss, log_probs)
    assert grad[~valid].eq(0).all()


def test_kl_estimators_hand_computed():
    lp, ref = torch.tensor([[-1.0]]), torch.tensor([[-1.5]])
    log_r = 0.5  # exact in float32; k1, k2 are then exact and k3 carries ~2 ulp of exp (approx: 1e-6)
    assert float(kl_penalty(lp, ref, "k1")) == pytest.approx(log_r)
    assert float(kl_penalty(lp, ref, "k2")) == pytest.approx(0.5 * log_r**2)
    assert float(kl_penalty(lp, ref, "k3")) == pytest.approx(math.exp(-log_r) - 1 + log_r)
    assert (kl_penalty(torch.randn(50), torch.randn(50), "k3") >= 0).all()


def test_kl_and_entropy_terms_enter_the_loss():
    log_probs, old, adv, mask, ref, entropy = random_batch(2)
    base = ppo_loss(log_probs, old, adv, mask, PPOLossConfig(), ref_log_probs=ref, entropy=entropy)
    full = ppo_loss(
        log_probs,
        old,
        adv,
        mask,
        PPOLossConfig(kl_coef=0.1, entropy_coef=0.01),
        ref_log_probs=ref,
        entropy=entropy,
    )
    expected = base.loss + 0.1 * base.metrics["losses/kl_ref"] - 0.01 * base.metrics["losses/entropy"]
    torch.testing.assert_close(full.loss, expected)
    (grad_entropy,) = torch.autograd.grad(full.loss, entropy)
    torch.testing.assert_close(grad_entropy, -0.01 * mask / mask.sum())


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_gradient_accumulation_with_global_denominator_equals_full_batch(mode):
    log_probs, old, adv, mask, ref, entropy = random_batch(3, B=6)
    config = PPOLossConfig(loss_agg_mode=mode, kl_coef=0.05, entropy_coef=0.01, dual_clip=3.0)
    full = ppo_loss(log_probs, old, adv, mask, config, ref_log_probs=ref, entropy=entropy)
    (want,) = torch.autograd.grad(full.loss, log_probs)
    denom = mask.sum() if mode == "token-mean" else (mask.sum(1) > 0).sum()
    total = 0.0
    for part in (slice(0, 2), slice(2, 6)):
        micro = ppo_loss(
            log_probs[part], old[part], adv[part], mask[part], config,
            ref_log_probs=ref[part], entropy=entropy[part], denominator=denom,
        )  # fmt: skip
        total = total + micro.loss
    (got,) = torch.autograd.grad(total, log_probs)
    torch.testing.assert_close(total, full.loss)
    torch.testing.assert_close(got, want)


def test_metrics_names_and_values():
    log_probs = torch.log(torch.tensor([[1.0, 1.5, 0.5, 1.0]]))
    out = ppo_loss(log_probs, torch.zeros(1, 4), torch.ones(1, 4), torch.tensor([[1, 1, 1, 0]]))
    m = {k: float(v) for k, v in out.metrics.items()}
    assert m["losses/clipfrac"] == pytest.approx(2 / 3)  # 1.5 and 0.5 are outside [0.8, 1.2]
    assert m["losses/pg_clipfrac"] == pytest.approx(1 / 3)  # only r = 1.5 with A > 0 is actually clipped
    assert m["losses/ratio_mean"] == pytest.approx(1.0)
    assert m["losses/ratio_max"] == pytest.approx(1.5) and m["losses/ratio_min"] == pytest.approx(0.5)
    # approx_kl (k3 of old || new) = mean((r - 1) - log r). float32: each term cancels ~1 ulp of r ~ 1
    # (6e-8) against a result ~0.1-0.2, so ~1e-6 relative; rel 1e-5 leaves ~10x
    want = ((0.5 - math.log(1.5)) + (-0.5 - math.log(0.5))) / 3
    assert m["losses/approx_kl"] == pytest.approx(want, rel=1e-5)
    assert m["losses/n_tokens"] == 3
    assert all(not v.requires_grad for v in out.metrics.values())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(dual_clip=1.0), "dual_clip"),
        (dict(loss_agg_mode="mean"), "loss_agg_mode"),
        (dict(kl_estimator="k4"), "kl_estimator"),
        (dict(clip_ratio_low=1.0), "clip ratios"),
        (dict(kl_coef=-1.0), "kl_coef"),
    ],
)
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PPOLossConfig(**kwargs)


def test_missing_reference_or_entropy_raises():
    log_probs, old, adv, mask, _, _ = random_batch()
    with pytest.raises(ValueError, match="ref_log_probs"):
        ppo_loss(log_probs, old, adv, mask, PPOLossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy"):
        ppo_loss(log_probs, old, adv, mask, PPOLossConfig(entropy_coef=0.1))
    with pytest.raises(ValueError, match="advantages shape"):
        ppo_loss(log_probs, old, adv[:, :-1], mask)


def test_tiny_model_pipeline_stats_to_otb_to_loss_is_finite(tiny_model_dir):
    """The learner core wired the way the trainer uses it: one no-grad pass for old log-probs and the
    proxy, OTB advantages, then a differentiable pass and the PPO loss with entropy and KL."""
    from agent_rl.advantages import AdvantageInputs, compute_advantages
    from agent_rl.build import load_model_and_tokenizer
    from agent_rl.logprobs import causal_lm_token_stats

    model, _ = load_model_and_tokenizer(tiny_model_dir)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (4, 12), generator=gen)
    attention = torch.ones_like(ids)
    response_mask = torch.ones(4, 6)
    response_mask[1, 2:4] = 0  # a tool span
    response_mask[3, 4:] = 0  # ends early
    rewards = torch.zeros(4, 6)
    rewards[0, 5], rewards[2, 5] = 1.0, 1.0
    with torch.no_grad():
        old = causal_lm_token_stats(model, ids, attention, response_length=6, temperature=0.8)
    inputs = AdvantageInputs(
        rewards,
        response_mask,
        ["p0", "p0", "p1", "p1"],
        old_log_probs=old.log_probs,
        sum_pi_squared=old.sum_pi_squared,
    )
    advantages = compute_advantages("tir_otb", inputs)
    new = causal_lm_token_stats(model, ids, attention, response_length=6, temperature=0.8)
    out = ppo_loss(
        new.log_probs,
        old.log_probs,
        advantages,
        response_mask,
        FULL,
        ref_log_probs=old.log_probs,
        entropy=new.entropy,
    )
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert torch.isfinite(out.loss) and grads and all(torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0
    # same weights, same inputs: the two passes' log-probs agree to float32 rounding (|log p| ~ 6 at
    # vocab 373: ulp 4.8e-7), so the ratio is 1 +- ~1e-6; abs 1e-5 leaves 10x
    assert float(out.metrics["losses/ratio_mean"]) == pytest.approx(1.0, abs=1e-5)
