"""Exact gradient statistics: per-sample gradients, variance, Spearman, and proxy == exact where it must be.

Tolerances. Per-sample gradients are flattened to float32 (grad_stats._flat_grad) even for the float64
bias-only policy, so exact-vs-proxy comparisons carry float32 rounding of a 7-entry gradient that is
squared and summed: a few ulp (2^-24 ~ 6e-8 relative); atol = rtol = 1e-6 is ~17 ulp of values <= ~1
(measured <= 11% of that tolerance). Moments and ranks are float64 sums of <= 66 terms (~1e-14
relative): rel 1e-9. Where no tolerance is given both sides are the same few ops, within torch's
dtype defaults (float32: rtol 1.3e-6, atol 1e-5) and pytest.approx's rel 1e-6 (measured: equal).
"""

from __future__ import annotations

import math

import pytest
import torch

from agent_rl.advantages import AdvantageInputs, compute_advantages, logit_gradient_proxy
from agent_rl.grad_stats import (
    exact_gradient_diagnostics,
    gradient_variance,
    per_sample_grad_sq_norms,
    per_sample_gradients,
    policy_gradient_objectives,
    prefix_grad_sq_norms,
    proxy_fidelity,
    proxy_grad_sq_norms,
    spearman_correlation,
)
from agent_rl.logprobs import token_stats_from_hidden


def test_per_sample_gradients_of_a_quadratic_model():
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(5, generator=gen, requires_grad=True)
    x = torch.randn(4, 5, generator=gen)
    objectives = (x @ theta).square()  # (B,) J_i = (x_i . theta)^2 -> grad = 2 (x_i . theta) x_i
    grads = per_sample_gradients(objectives, [theta])
    torch.testing.assert_close(grads, 2 * (x @ theta.detach())[:, None] * x)
    torch.testing.assert_close(per_sample_grad_sq_norms(objectives, [theta]), grads.square().sum(1))


def test_gradient_variance_matches_definition():
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(6, 11, generator=gen)
    stats = gradient_variance(g)
    assert stats.variance == pytest.approx(float(g.double().var(dim=0, unbiased=True).sum()), rel=1e-9)
    assert stats.mean_grad_sq_norm == pytest.approx(float(g.double().mean(0).square().sum()), rel=1e-9)
    # identity: trace Cov = B/(B-1) (E||g||^2 - ||E g||^2)
    assert stats.variance == pytest.approx(6 / 5 * (stats.mean_sq_norm - stats.mean_grad_sq_norm), rel=1e-9)
    with pytest.raises(ValueError, match="B >= 2"):
        gradient_variance(g[:1])


def test_spearman_hand_computed_with_ties():
    # ranks x = [1, 2.5, 2.5, 4], y = [1, 3, 2, 4]; centred dot 4.5, norms^2 4.5 and 5
    rho = spearman_correlation(torch.tensor([1.0, 2.0, 2.0, 3.0]), torch.tensor([1.0, 3.0, 2.0, 4.0]))
    assert rho == pytest.approx(4.5 / math.sqrt(4.5 * 5.0))
    x = torch.randn(20, generator=torch.Generator().manual_seed(2))
    assert spearman_correlation(x, x.exp()) == pytest.approx(1.0)  # invariant to monotone maps
    assert spearman_correlation(x, -(x**3)) == pytest.approx(-1.0)
    assert math.isnan(spearman_correlation(x, torch.ones(20)))
    with pytest.raises(ValueError, match="same number"):
        spearman_correlation(x, x[:-1])


def bias_only_policy(seed=0, B=3, L=5, V=7):
    """logits = F + bias with fixed F: the parameter gradient of log p(y_t) is exactly e_y - p_t."""
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(B, L, V, generator=gen, dtype=torch.float64) * 1.5  # (B, L, V) fixed logits
    bias = torch.zeros(V, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (B, L), generator=gen)
    stats = token_stats_from_hidden(features, torch.eye(V, dtype=torch.float64), targets, bias=bias)
    mask = torch.ones(B, L, dtype=torch.float64)
    mask[0, 1:3] = 0  # tool span
    mask[2, 3:] = 0  # shorter response
    return stats, targets, mask, bias, features


def test_exact_per_token_norm_equals_the_proxy_for_a_bias_only_policy():
    stats, targets, mask, bias, features = bias_only_policy()
    exact = prefix_grad_sq_norms(stats.log_probs, mask, [bias])
    w = logit_gradient_proxy(stats.log_probs.detach(), stats.sum_pi_squared, mask)
    torch.testing.assert_close(exact.per_token.double(), w, atol=1e-6, rtol=1e-6)
    # prefix: ||sum_{j<=t} (e_yj - p_j)||^2 over policy tokens, carried across masked ones
    p = torch.softmax(features, -1)
    scores = torch.nn.functional.one_hot(targets, p.shape[-1]).double() - p  # (B, L, V)
    running = (scores * mask[..., None]).cumsum(1)
    torch.testing.assert_close(exact.prefix.double(), running.square().sum(-1), atol=1e-6, rtol=1e-6)
    seq = torch.where(mask.bool(), stats.log_probs, torch.zeros_like(stats.log_probs)).sum(1)
    torch.testing.assert_close(exact.total, per_sample_grad_sq_norms(seq, [bias]), atol=1e-6, rtol=1e-6)
    # so exact_optimal on the exact per-token norms reproduces OTB on the proxy
    rewards = torch.zeros_like(mask)
    rewards[0, -1], rewards[1, -1], rewards[2, 2] = 1.0, 0.0, 1.0
    groups = [0, 0, 0]
    exact_adv = compute_advantages(
        "exact_optimal",
        AdvantageInputs(rewards, mask, groups, grad_sq_norms=exact.per_token),
        cumulative=False,
    )
    otb_adv = compute_advantages(
        "otb",
        AdvantageInputs(
            rewards, mask, groups, old_log_probs=stats.log_probs.detach(), sum_pi_squared=stats.sum_pi_squared
        ),
    )
    torch.testing.assert_close(exact_adv, otb_adv, atol=1e-6, rtol=1e-6)
    # the accumulated proxy ranks sequences exactly like the sum of exact per-token norms
    assert proxy_fidelity(w, mask, exact.per_token.sum(1)) == pytest.approx(1.0)


def test_proxy_fidelity_uses_only_policy_tokens():
    w = torch.tensor([[1.0, 100.0, 1.0], [2.0, 2.0, 0.0], [0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 0, 1], [1, 1, 0], [1, 0, 0]])
    true = torch.tensor([2.0, 4.0, 0.5])  # W_last = [2, 4, 0.5] once the masked 100 is ignored
    assert proxy_fidelity(w, mask, true) == pytest.approx(1.0)
    assert proxy_fidelity(w, torch.ones_like(mask), true) < 1.0


def test_per_sample_policy_gradients_sum_to_the_batch_gradient():
    stats, _, mask, bias, _ = bias_only_policy(seed=3)
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    objectives = policy_gradient_objectives(stats.log_probs, adv, mask)
    per_sample = per_sample_gradients(objectives, [bias])
    (batch,) = torch.autograd.grad(objectives.sum(), bias, retain_graph=True)
    # 3 float32-rounded gradients summed in float32 vs one float64 gradient: ~3 ulp of entries <= ~3,
    # i.e. <~ 5e-7 (measured 7.5e-8); 1e-5 leaves 20x and is 1e-5 of a missing row's contribution
    torch.testing.assert_close(per_sample.sum(0).double(), batch, atol=1e-5, rtol=1e-5)
    # forward-only proxy: sum_t A_t^2 w_t, hand-checked on the masked terms
    w = logit_gradient_proxy(stats.log_probs.detach(), stats.sum_pi_squared, mask)
    torch.testing.assert_close(proxy_grad_sq_norms(adv, w, mask), (adv.square() * w * mask).sum(1))


def test_tiny_model_prefix_total_equals_sequence_gradient_norm(tiny_model_dir):
    from agent_rl.build import load_model_and_tokenizer
    from agent_rl.logprobs import causal_lm_token_stats

    model, _ = load_model_and_tokenizer(tiny_model_dir)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    stats = causal_lm_token_stats(model, ids, response_length=4)
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 0]])
    params = list(model.parameters())
    exact = prefix_grad_sq_norms(stats.log_probs, mask, params)
    seq = torch.where(mask.bool(), stats.log_probs, torch.zeros_like(stats.log_probs)).sum(1)
    # float32: sum of 3 per-token gradients vs autograd's own accumulation, then a squared norm over
    # ~1e5 parameters: ~1e-6 relative even with some cancellation between tokens (measured: equal
    # under AVX-512, 1e-7 relative under AVX2); rtol 1e-4 leaves 100x
    torch.testing.assert_close(exact.total, per_sample_grad_sq_norms(seq, params), rtol=1e-4, atol=1e-6)
    assert (exact.per_token[mask.bool()] > 0).all() and exact.per_token[~mask.bool()].eq(0).all()


def test_exact_gradient_diagnostics_combines_the_pieces_and_drops_invalid_rows():
    stats, _, mask, bias, _ = bias_only_policy(seed=5, B=5)
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    valid = torch.tensor([True, True, False, True, True])
    diag = exact_gradient_diagnostics(stats.log_probs, adv, mask, stats.sum_pi_squared, [bias], valid=valid)
    keep = valid.nonzero().squeeze(1)
    seq = torch.where(mask.bool(), stats.log_probs, torch.zeros_like(stats.log_probs)).sum(1)[keep]
    torch.testing.assert_close(diag.grad_sq_norms, per_sample_grad_sq_norms(seq, [bias]))
    w = logit_gradient_proxy(stats.log_probs.detach(), stats.sum_pi_squared, mask)[keep]
    torch.testing.assert_close(diag.proxy_cum_weight, (w * mask[keep]).sum(1))
    assert diag.proxy_spearman == pytest.approx(
        spearman_correlation(diag.proxy_cum_weight, diag.grad_sq_norms)
    )
    pg = per_sample_gradients(
        policy_gradient_objectives(stats.log_probs[keep], adv[keep], mask[keep]), [bias]
    )
    # the same float32 per-sample gradients, with invalid rows dropped before vs after: ~1 ulp each
    # (measured: equal), float64 moments; rel 1e-6 ~ 17 ulp
    assert diag.pg.variance == pytest.approx(gradient_variance(pg).variance, rel=1e-6)
    metrics = diag.metrics()
    assert set(metrics) >= {"grad/exact_pg_variance", "grad/proxy_spearman", "grad/proxy_pg_sq_norm"}
    assert all(math.isfinite(v) for v in metrics.values())
