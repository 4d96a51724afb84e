"""Off-policy correction: the weights by hand, the metrics on a perturbed sampler, and the gradient it fixes."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from agent_rl.config import AlgoConfig, TrainConfig, build_config  # noqa: E402
from agent_rl.loss import PPOLossConfig, ppo_loss  # noqa: E402
from agent_rl.offpolicy import ISCorrection, importance_weights, mismatch_metrics, resolve_mode  # noqa: E402


def test_token_weights_are_rho_truncated_at_c() -> None:
    rho = torch.tensor([[0.5, 1.0, 3.0, 10.0]])
    trainer = rho.log()
    sampler = torch.zeros(1, 4)
    mask = torch.tensor([[True, True, True, False]])
    out = importance_weights(trainer, sampler, mask, ISCorrection("token", cap=2.0))
    assert out is not None
    torch.testing.assert_close(out.weights, torch.tensor([[0.5, 1.0, 2.0, 0.0]]))
    assert importance_weights(trainer, sampler, mask, ISCorrection("off")) is None


def test_sequence_modes_reject_rows_outside_the_band() -> None:
    # row 0: geometric mean 1 (ratios 2 and 0.5), product 1; row 1: both 1.5 -> geo 1.5, product 2.25
    rho = torch.tensor([[2.0, 0.5], [1.5, 1.5]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    geo = importance_weights(
        rho.log(), torch.zeros(2, 2), mask, ISCorrection("geometric", cap=5.0, band=(0.8, 1.2))
    )
    assert geo is not None and geo.sequence_kept.tolist() == [True, False]
    torch.testing.assert_close(geo.weights, torch.tensor([[2.0, 0.5], [0.0, 0.0]]))
    seq = importance_weights(
        rho.log(), torch.zeros(2, 2), mask, ISCorrection("sequence", cap=5.0, band=(0.5, 2.0))
    )
    assert seq is not None and seq.sequence_kept.tolist() == [True, False]
    wide = importance_weights(
        rho.log(), torch.zeros(2, 2), mask, ISCorrection("sequence", cap=5.0, band=(0.5, 3.0))
    )
    assert wide is not None and wide.sequence_kept.tolist() == [True, True]


def test_padding_garbage_does_not_leak_into_weights_or_metrics() -> None:
    trainer = torch.tensor([[-1.0, float("-inf")]])
    sampler = torch.tensor([[-1.0, float("nan")]])
    mask = torch.tensor([[True, False]])
    out = importance_weights(trainer, sampler, mask, ISCorrection("sequence"))
    assert out is not None and out.weights.tolist() == [[1.0, 0.0]]
    metrics = mismatch_metrics(trainer, sampler, mask, out.weights)
    assert metrics["offpolicy/mismatch_kl"] == 0.0 and metrics["offpolicy/ratio_max"] == 1.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"mode": "auto"}, "resolve"), ({"cap": 0.5}, "is_cap"), ({"band": (1.1, 2.0)}, "band")],
)
def test_correction_rejects_bad_settings(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match if match != "resolve" else "mode must be one of"):
        ISCorrection(**{"mode": "token", **kwargs})


def test_auto_is_off_for_hf_and_token_for_vllm() -> None:
    assert resolve_mode("auto", "hf") == "off" and resolve_mode("auto", "vllm") == "token"
    assert resolve_mode("geometric", "hf") == "geometric"
    assert build_config({}).algo.is_correction == "off"
    assert build_config({}, ["rollout.engine=vllm"]).algo.is_correction == "token"
    assert build_config({}, ["rollout.engine=vllm", "algo.is_correction=off"]).algo.is_correction == "off"


# ------------------------------------------------------------------ a deliberately perturbed sampler

V = 12


def _policy(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    theta = (torch.randn(V, generator=g, dtype=torch.float64) * 1.5).requires_grad_()
    advantage = torch.randn(V, generator=g, dtype=torch.float64)  # A(y): a fixed per-token advantage
    return theta, advantage


def _samples(
    theta: torch.Tensor, sampler_temperature: float, n: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """n tokens drawn from softmax(theta / T_s), and the sampler's log-probs of them (what an engine reports)."""
    sampler_logp = torch.log_softmax(theta.detach() / sampler_temperature, -1)
    y = torch.multinomial(
        sampler_logp.exp(), n, replacement=True, generator=torch.Generator().manual_seed(seed)
    )
    return y, sampler_logp[y]


def _loss_gradient(
    theta, advantage, y, sampler_lp, correction: ISCorrection
) -> tuple[torch.Tensor, dict[str, float]]:
    """The PPO loss gradient at ratio 1 (first minibatch), as the learner takes it: trainer log-probs
    at T = 1 (what the trainer believes the sampler used)."""
    theta.grad = None
    log_pi = torch.log_softmax(theta, -1)[y][None, :]  # (1, N)
    old = log_pi.detach()
    mask = torch.ones_like(old, dtype=torch.bool)
    weights = importance_weights(old, sampler_lp[None, :], mask, correction)
    out = ppo_loss(
        log_pi,
        old,
        advantage[y][None, :],
        mask,
        PPOLossConfig(),
        is_weights=None if weights is None else weights.weights,
    )
    out.loss.backward()
    metrics = mismatch_metrics(old, sampler_lp[None, :], mask, None if weights is None else weights.weights)
    return -theta.grad.clone(), metrics


def test_a_perturbed_sampler_is_detected_and_corrected() -> None:
    """Tokens sampled at temperature 1.6 while the trainer assumes 1.0: the metrics flag it, and the
    truncated-IS gradient is much closer to the exact on-policy gradient than the uncorrected one."""
    theta, advantage = _policy()
    pi = torch.softmax(theta, -1)
    (exact,) = torch.autograd.grad((pi * advantage).sum(), theta)  # grad E_pi[A] = E_pi[A grad log pi]

    y, lp = _samples(theta, 1.0, 40_000, seed=1)
    _, on_policy_metrics = _loss_gradient(theta, advantage, y, lp, ISCorrection("off"))
    assert (
        on_policy_metrics["offpolicy/mismatch_kl"] < 1e-12 and on_policy_metrics["offpolicy/ratio_max"] == 1.0
    )

    y, lp = _samples(theta, 1.6, 40_000, seed=1)
    plain, metrics = _loss_gradient(theta, advantage, y, lp, ISCorrection("off"))
    corrected, cmetrics = _loss_gradient(theta, advantage, y, lp, ISCorrection("token", cap=5.0))
    assert metrics["offpolicy/mismatch_kl"] > 0.02 and metrics["offpolicy/ratio_max"] > 1.5
    assert cmetrics["offpolicy/weight_mean"] == pytest.approx(1.0, abs=0.05)  # E_sampler[rho] = 1

    err_plain = float((plain - exact).norm() / exact.norm())
    err_corrected = float((corrected - exact).norm() / exact.norm())
    # Monte-Carlo error of the corrected estimate at n = 40k is a few percent; the bias of the
    # uncorrected one does not shrink with n.
    assert err_plain > 0.15, err_plain
    assert err_corrected < err_plain / 3, (err_corrected, err_plain)


def test_truncation_trades_a_little_bias_for_bounded_weights() -> None:
    theta, advantage = _policy(seed=3)
    y, lp = _samples(theta, 2.0, 20_000, seed=2)
    _, metrics = _loss_gradient(theta, advantage, y, lp, ISCorrection("token", cap=1.2))
    assert metrics["offpolicy/truncated_frac"] > 0.0 and metrics["offpolicy/masked_frac"] == 0.0
    assert (
        math.isfinite(metrics["offpolicy/ratio_p99"])
        and metrics["offpolicy/ratio_p99"] <= metrics["offpolicy/ratio_max"]
    )


# ------------------------------------------------------------------ the learner wires it through


@pytest.fixture()
def model(tiny_model_dir):
    from agent_rl.build import load_model_and_tokenizer

    torch.manual_seed(0)
    m, _ = load_model_and_tokenizer(tiny_model_dir)
    return m


def _batch_sampled_at(learner, temperature: float):
    """A batch whose sampler log-probs are the tiny model's own at another temperature."""
    from agent_rl.batch import batch_from_tensors
    from agent_rl.logprobs import causal_lm_token_stats

    g = torch.Generator().manual_seed(0)
    b, p, r = 8, 5, 9
    ids = torch.randint(10, 300, (b, p + r), generator=g)
    mask = torch.ones(b, r)
    rewards = torch.zeros(b, r)
    rewards[:, -1] = torch.tensor([1.0, 0, 0, 1, 1, 0, 1, 0])
    with torch.no_grad():
        lp = causal_lm_token_stats(learner.model, ids, response_length=r, temperature=temperature).log_probs
    return batch_from_tensors(ids, mask, lp, rewards, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))


def test_learner_feeds_the_weights_to_otb_and_the_loss(model) -> None:
    from agent_rl.advantages import AdvantageInputs, compute_advantages
    from agent_rl.learner import Learner, step_metrics

    algo = AlgoConfig(estimator="tir_otb", is_correction="token", is_cap=1.2)
    learner = Learner(model, algo, TrainConfig(lr=1e-3))
    batch = _batch_sampled_at(learner, temperature=0.5)
    scored = learner.prepare(batch)
    assert scored.is_weights is not None and scored.loss_weights is scored.is_weights
    rho = (scored.scores.trainer_log_probs - batch.sampler_log_probs).exp()
    torch.testing.assert_close(scored.is_weights, rho.clamp(max=1.2))
    expected = compute_advantages(
        "tir_otb",
        AdvantageInputs(
            token_rewards=batch.token_rewards,
            response_mask=batch.response_mask,
            group_index=batch.group_index,
            old_log_probs=scored.scores.trainer_log_probs,
            sum_pi_squared=scored.scores.sum_pi_squared,
            is_weights=scored.is_weights,
        ),
    )
    torch.testing.assert_close(scored.advantages, expected)
    unweighted = Learner(model, AlgoConfig(estimator="tir_otb"), TrainConfig()).prepare(batch)
    assert unweighted.is_weights is None and not torch.allclose(unweighted.advantages, scored.advantages)
    metrics = step_metrics(scored)
    assert metrics["offpolicy/mismatch_kl"] > 1e-3 and metrics["offpolicy/truncated_frac"] > 0
    _, step = learner.step(batch)
    assert math.isfinite(step["losses/loss"])


def test_same_temperature_sampler_shows_no_mismatch(model) -> None:
    from agent_rl.learner import Learner, step_metrics

    learner = Learner(model, AlgoConfig(is_correction="token"), TrainConfig())
    scored = learner.prepare(_batch_sampled_at(learner, temperature=1.0))
    metrics = step_metrics(scored)
    # the same model and kernels: rho = 1 up to float32 rounding of two identical passes
    assert metrics["offpolicy/mismatch_kl"] < 1e-9 and metrics["offpolicy/ratio_max"] < 1 + 1e-5
    assert metrics["offpolicy/truncated_frac"] == 0.0
