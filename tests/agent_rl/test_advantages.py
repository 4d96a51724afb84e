"""Advantage estimators: hand-computed cases, edge cases, cross-estimator identities, loop reference.

Tolerances. Inputs here are float64 unless a test says otherwise, and two computations of the same
quantity differ only by re-association of sums of <= 24 terms (~24 x 2^-53 ~ 3e-15 relative), so
where no tolerance is given torch's float64 default (rtol = atol = 1e-7) is ~1e7 x that and still far
below what a wrong formula gives (O(0.1) in these cases). The explicit atol=1e-7 / 1e-6 sites compare with
expectations written without the estimator's OTB_EPS = 1e-8 in the baseline's denominator, which
shifts b by |b| eps / sum W: at most ~4e-8 in those tests (each states its margin).
"""

from __future__ import annotations

import math

import pytest
import torch

from agent_rl.advantages import (
    AdvantageInputs,
    available_estimators,
    compute_advantages,
    logit_gradient_proxy,
    optimal_token_baseline,
    register_estimator,
    required_inputs,
    unregister_estimator,
)

ALL = ("otb", "tir_otb", "grpo", "rloo", "opo", "reinforce", "exact_optimal")


def proxy_inputs_for_w(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """old_log_probs and sum_pi_squared whose proxy is exactly w: p(y) = 0.5 gives 1 - 1 + s = s."""
    return torch.full_like(w, math.log(0.5)), w.clone()


def make_inputs(rewards, mask, groups, w=None, **kw) -> AdvantageInputs:
    rewards = torch.as_tensor(rewards, dtype=torch.float64)
    mask = torch.as_tensor(mask, dtype=torch.float64)
    if w is None:
        w = torch.full_like(rewards, 0.5)
    lp, s = proxy_inputs_for_w(torch.as_tensor(w, dtype=torch.float64))
    return AdvantageInputs(rewards, mask, groups, old_log_probs=lp, sum_pi_squared=s, **kw)


# ---------------------------------------------------------------- loop reference (slow, obviously right)


def reference_otb(
    rewards, mask, old_lp, sp2, groups, *, multi_turn, handle_zero_tail, is_weights=None, valid=None
):
    """OTB straight from docs/otb.md with Python loops over rows, groups and positions (float64)."""
    B, L = rewards.shape
    ok = [True] * B if valid is None else [bool(v) for v in valid]
    m = [[bool(mask[i, t]) and ok[i] for t in range(L)] for i in range(B)]
    W = [[0.0] * L for _ in range(B)]
    G = [[0.0] * L for _ in range(B)]
    for i in range(B):
        acc = 0.0
        for t in range(L):
            if m[i][t]:
                w = max(1.0 - 2.0 * math.exp(float(old_lp[i, t])) + float(sp2[i, t]), 0.0)
                if is_weights is not None:
                    w *= float(is_weights[i, t]) ** 2
                acc += w
            W[i][t] = acc
        for t in range(L):
            G[i][t] = sum(float(rewards[i, j]) for j in range(t, L) if m[i][j])
    # slots[i] = list of (index along the aligned axis, absolute position)
    slots = []
    for i in range(B):
        pos = [t for t in range(L) if m[i][t]]
        slots.append([(k, t) for k, t in enumerate(pos)] if multi_turn else [(t, t) for t in pos])
    A = torch.zeros(B, L, dtype=torch.float64)
    for g in set(groups):
        members = [i for i in range(B) if groups[i] == g and ok[i]]
        by_index: dict[int, list[tuple[int, int]]] = {}
        for i in members:
            for k, t in slots[i]:
                by_index.setdefault(k, []).append((i, t))
        for entries in by_index.values():
            if len(members) == 1 or (handle_zero_tail and len(entries) == 1):
                b = 0.0
            else:
                b = sum(G[i][t] * W[i][t] for i, t in entries) / (sum(W[i][t] for i, t in entries) + 1e-8)
            for i, t in entries:
                A[i, t] = G[i][t] - b
    return A


def random_batch(seed: int, *, tool_spans: bool, dense: bool = False):
    """Groups of 1..5, ragged lengths, optional tool spans (mask 0) in the middle, garbage off-mask."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 6, (4,), generator=gen).tolist()
    groups = [f"prompt-{g}" for g, n in enumerate(sizes) for _ in range(n)]
    B, L = len(groups), 24
    mask = torch.zeros(B, L, dtype=torch.float64)
    rewards = torch.zeros(B, L, dtype=torch.float64)
    for i in range(B):
        length = int(torch.randint(1, L + 1, (1,), generator=gen))
        mask[i, :length] = 1
        if tool_spans and length > 4:
            for _ in range(int(torch.randint(1, 3, (1,), generator=gen))):
                start = int(torch.randint(1, length - 2, (1,), generator=gen))
                span = int(torch.randint(1, 5, (1,), generator=gen))
                mask[i, start : min(start + span, length - 1)] = 0
        last = int(mask[i].nonzero().max())
        rewards[i, last] = float(torch.randint(0, 2, (1,), generator=gen))
        if dense:
            rewards[i] += torch.where(
                mask[i] > 0, torch.randn(L, generator=gen, dtype=torch.float64) * 0.1, 0.0
            )
    probs = torch.rand(B, L, generator=gen, dtype=torch.float64) * 0.98 + 0.01
    old_lp = probs.log()
    # a plausible collision term: at least p^2, at most p^2 + (1-p)^2
    sp2 = probs.square() + torch.rand(B, L, generator=gen, dtype=torch.float64) * (1 - probs).square()
    return rewards, mask, old_lp, sp2, groups


# ---------------------------------------------------------------- OTB: hand-computed cases


def test_otb_hand_computed_two_responses():
    # row 0: w = [0.5, 0.5] -> W = [0.5, 1.0], G = [1, 1];  row 1: w = [0.75, 0.25] -> W = [0.75, 1.0], G = [0, 0]
    # b_0 = 0.5 / 1.25 = 0.4 ; b_1 = 1.0 / 2.0 = 0.5
    w = torch.tensor([[0.5, 0.5], [0.75, 0.25]], dtype=torch.float64)
    inputs = make_inputs([[0.0, 1.0], [0.0, 0.0]], [[1, 1], [1, 1]], ["a", "a"], w=w)
    adv = compute_advantages("otb", inputs)
    expected = torch.tensor([[0.6, 0.5], [-0.4, -0.5]], dtype=torch.float64)
    # OTB_EPS shift: b eps / sum W <= 0.5 x 1e-8 / 1.25 = 4e-9; atol 1e-7 leaves 25x
    torch.testing.assert_close(adv, expected, atol=1e-7, rtol=0)


def test_otb_proxy_from_probabilities():
    # p(y) = 0.25, sum p^2 = 0.625 (distribution [0.25, 0.75]) -> w = 1 - 0.5 + 0.625 = 1.125 = ||e_y - p||^2
    p = torch.tensor([0.25, 0.75], dtype=torch.float64)
    e_y = torch.tensor([1.0, 0.0], dtype=torch.float64)
    w = logit_gradient_proxy(
        torch.tensor([[math.log(0.25)]], dtype=torch.float64),
        torch.tensor([[0.625]], dtype=torch.float64),
        torch.ones(1, 1),
        is_weights=torch.tensor([[2.0]], dtype=torch.float64),
    )
    torch.testing.assert_close(w, ((e_y - p).square().sum() * 4.0).reshape(1, 1))


def test_tir_tool_span_in_the_middle_aligns_on_kth_policy_token():
    # row 0: mask [1,0,0,1], w=0.5, R=1 at t=3 ; row 1: mask [1,1,0,0], w=0.25, R=0.
    # TIR, k=0: b = (1*0.5)/(0.5+0.25) = 2/3 ; k=1: W = 1.0 vs 0.5 -> b = 1/(1.5) = 2/3.
    w = torch.tensor([[0.5] * 4, [0.25] * 4], dtype=torch.float64)
    rewards = [[0, 0, 0, 1.0], [0, 0, 0, 0]]
    mask = [[1, 0, 0, 1], [1, 1, 0, 0]]
    tir = compute_advantages("tir_otb", make_inputs(rewards, mask, [7, 7], w=w))
    third = 1.0 / 3.0
    # OTB_EPS shift: (2/3) x 1e-8 / 0.75 ~ 9e-9 (k=0, the smallest sum W); atol 1e-7 leaves 10x
    torch.testing.assert_close(
        tir,
        torch.tensor([[third, 0, 0, third], [-2 * third, -2 * third, 0, 0]], dtype=torch.float64),
        atol=1e-7,
        rtol=0,
    )
    # absolute positions: t=1 has only row 1, t=3 only row 0 -> zero tail -> A = G there.
    flat = compute_advantages("otb", make_inputs(rewards, mask, [7, 7], w=w))
    torch.testing.assert_close(
        flat,
        torch.tensor([[third, 0, 0, 1.0], [-2 * third, 0, 0, 0]], dtype=torch.float64),
        atol=1e-7,
        rtol=0,
    )


def test_zero_tail_on_and_off():
    # row 0 generates 3 tokens, row 1 one token. At t = 1, 2 only row 0 is active.
    rewards = [[0, 0, 1.0], [1.0, 0, 0]]
    mask = [[1, 1, 1], [1, 0, 0]]
    on = compute_advantages("otb", make_inputs(rewards, mask, [0, 0]))
    off = compute_advantages("otb", make_inputs(rewards, mask, [0, 0]), handle_zero_tail=False)
    # t = 0: both W = 0.5, G = [1, 1] -> b = 1 -> A = 0 for both.
    # OTB_EPS shift: A = G eps / (sum W + eps) = 1e-8 / 1.0; atol 1e-7 leaves 10x
    torch.testing.assert_close(on[:, 0], torch.zeros(2, dtype=torch.float64), atol=1e-7, rtol=0)
    torch.testing.assert_close(on[0, 1:], torch.ones(2, dtype=torch.float64))  # baseline 0 -> A = G = 1
    # b = G W / (W + eps) ~ G: the signal the handling protects. A = G eps / (W + eps) <= 1e-8 here
    # (W >= 1.0): 1e-6 is 100x that and a millionth of the signal G = 1.
    assert off[0, 1:].abs().max() < 1e-6
    assert off[1, 1:].eq(0).all() and on[1, 1:].eq(0).all()


@pytest.mark.parametrize("handle_zero_tail", [True, False])
@pytest.mark.parametrize("name", ["otb", "tir_otb"])
def test_group_of_one_gets_no_baseline(name, handle_zero_tail):
    rewards = [[0, 0.5, 0, 2.0, 0], [0, 0, 0, 0, 0]]
    mask = [[1, 1, 0, 1, 0], [1, 1, 1, 1, 1]]
    adv = compute_advantages(name, make_inputs(rewards, mask, ["x", "y"]), handle_zero_tail=handle_zero_tail)
    # reward-to-go on policy tokens, 0 elsewhere; row 1 has reward 0 everywhere
    expected = torch.tensor([[2.5, 2.5, 0, 2.0, 0], [0, 0, 0, 0, 0]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected)


def test_invalid_sequence_excluded_from_baseline_and_zeroed():
    rewards, mask, old_lp, sp2, groups = random_batch(3, tool_spans=False)
    valid = torch.ones(len(groups), dtype=torch.bool)
    valid[0] = False
    rewards[0] = torch.where(mask[0] > 0, torch.full_like(rewards[0], 0.0), 0.0)
    rewards[0, 0] = 1e6  # an infra failure with a nonsense reward must not move anyone's baseline
    full = AdvantageInputs(rewards, mask, groups, old_log_probs=old_lp, sum_pi_squared=sp2, valid=valid)
    for name in ("otb", "tir_otb", "grpo", "rloo", "opo", "reinforce"):
        adv = compute_advantages(name, full)
        assert adv[0].eq(0).all(), name
        rest = AdvantageInputs(
            rewards[1:], mask[1:], groups[1:], old_log_probs=old_lp[1:], sum_pi_squared=sp2[1:]
        )
        torch.testing.assert_close(adv[1:], compute_advantages(name, rest), msg=name)


def test_importance_weights_scale_the_proxy_by_rho_squared():
    rewards, mask, old_lp, sp2, groups = random_batch(5, tool_spans=True)
    rho = torch.rand(rewards.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) + 0.5
    got = optimal_token_baseline(rewards, mask, old_lp, sp2, groups, multi_turn=True, is_weights=rho)
    want = reference_otb(
        rewards, mask, old_lp, sp2, groups, multi_turn=True, handle_zero_tail=True, is_weights=rho
    )
    torch.testing.assert_close(got, want)
    plain = optimal_token_baseline(rewards, mask, old_lp, sp2, groups, multi_turn=True)
    assert not torch.allclose(got, plain)  # rho in [0.5, 1.5) moves b by O(0.1) >> allclose's 1e-5


# ---------------------------------------------------------------- vectorised == loop reference


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("multi_turn", [False, True])
@pytest.mark.parametrize("handle_zero_tail", [True, False])
def test_vectorised_matches_loop_reference(seed, multi_turn, handle_zero_tail):
    rewards, mask, old_lp, sp2, groups = random_batch(seed, tool_spans=True, dense=seed % 2 == 1)
    valid = torch.rand(len(groups), generator=torch.Generator().manual_seed(seed)) > 0.15
    got = optimal_token_baseline(
        rewards, mask, old_lp, sp2, groups, multi_turn=multi_turn, handle_zero_tail=handle_zero_tail
    )
    want = reference_otb(
        rewards, mask, old_lp, sp2, groups, multi_turn=multi_turn, handle_zero_tail=handle_zero_tail
    )
    # float64, same eps both sides: re-association of <= 24-term sums, ~24 x 2^-53 x |G| (|G| < 4)
    # < 1e-14; 1e-10 leaves 1e4x and is still ~1e8x below a wrong baseline
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    name = "tir_otb" if multi_turn else "otb"
    inputs = AdvantageInputs(rewards, mask, groups, old_log_probs=old_lp, sum_pi_squared=sp2, valid=valid)
    got_valid = compute_advantages(name, inputs, handle_zero_tail=handle_zero_tail)
    want_valid = reference_otb(
        rewards,
        mask,
        old_lp,
        sp2,
        groups,
        multi_turn=multi_turn,
        handle_zero_tail=handle_zero_tail,
        valid=valid,
    )
    torch.testing.assert_close(got_valid, want_valid, atol=1e-10, rtol=1e-10)


def test_tir_differs_from_single_turn_only_when_tool_spans_misalign():
    rewards, mask, old_lp, sp2, groups = random_batch(11, tool_spans=False)
    single = optimal_token_baseline(rewards, mask, old_lp, sp2, groups)
    tir = optimal_token_baseline(rewards, mask, old_lp, sp2, groups, multi_turn=True)
    torch.testing.assert_close(single, tir)  # contiguous masks: k-th policy token == position k
    rewards, mask, old_lp, sp2, groups = random_batch(11, tool_spans=True)
    single = optimal_token_baseline(rewards, mask, old_lp, sp2, groups)
    tir = optimal_token_baseline(rewards, mask, old_lp, sp2, groups, multi_turn=True)
    assert not torch.allclose(single, tir)  # misaligned positions change b by O(0.1) >> 1e-5


def test_float32_and_group_ids_as_tensor():
    rewards, mask, old_lp, sp2, groups = random_batch(2, tool_spans=True)
    dense_ids = torch.tensor([int(g.split("-")[1]) for g in groups])
    got = optimal_token_baseline(rewards.float(), mask.float(), old_lp.float(), sp2.float(), dense_ids)
    want = reference_otb(rewards, mask, old_lp, sp2, groups, multi_turn=False, handle_zero_tail=True)
    assert got.dtype == torch.float32
    # float32 vs the float64 reference: inputs rounded to 2^-24, w = 1 - 2p + s cancels terms ~1 down
    # to >= (1-p)^2 >= 1e-4, sums of <= 24 terms. Measured 5e-8 (AVX2 and AVX-512); 1e-5 is ~170 ulp
    # of |A| <= 1 and still 1e4 below a wrong baseline
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- masked tokens are exactly 0


@pytest.mark.parametrize("name", ALL)
def test_masked_tokens_get_exactly_zero(name):
    rewards, mask, old_lp, sp2, groups = random_batch(7, tool_spans=True)
    off = mask == 0
    old_lp = torch.where(off, torch.full_like(old_lp, -1e30), old_lp)  # garbage where nothing was sampled
    sp2 = torch.where(off, torch.full_like(sp2, 1e30), sp2)
    norms = torch.rand(rewards.shape, dtype=torch.float64)
    inputs = AdvantageInputs(
        rewards, mask, groups, old_log_probs=old_lp, sum_pi_squared=sp2, grad_sq_norms=norms
    )
    adv = compute_advantages(name, inputs)
    assert adv.shape == rewards.shape
    assert torch.isfinite(adv).all()
    assert adv[off].eq(0).all()
    assert adv[~off].ne(0).any()


# ---------------------------------------------------------------- agreement where theory says so


def equal_length_outcome_batch(seed: int, n: int = 4, groups: int = 3, length: int = 6):
    gen = torch.Generator().manual_seed(seed)
    B = n * groups
    rewards = torch.zeros(B, length, dtype=torch.float64)
    rewards[:, -1] = torch.randint(0, 2, (B,), generator=gen).double() + torch.rand(
        B, generator=gen, dtype=torch.float64
    )
    mask = torch.ones(B, length, dtype=torch.float64)
    ids = [g for g in range(groups) for _ in range(n)]
    return rewards, mask, ids


@pytest.mark.parametrize("name", ["otb", "tir_otb"])
def test_constant_w_equal_lengths_is_grpo_without_std(name):
    rewards, mask, ids = equal_length_outcome_batch(0)
    otb_adv = compute_advantages(name, make_inputs(rewards, mask, ids, w=torch.full_like(rewards, 0.3)))
    grpo_adv = compute_advantages("grpo", make_inputs(rewards, mask, ids))
    # OTB_EPS shift: |b| eps / sum W with |b| < 2, sum W >= 4 x 0.3: < 2e-8 (measured 1.2e-8); 1e-6 is 50x
    torch.testing.assert_close(otb_adv, grpo_adv, atol=1e-6, rtol=0)


def test_equal_w_gives_group_mean_of_reward_to_go_per_position():
    # dense rewards, ragged lengths: b_t with equal per-token w (and equal W among active rows at t
    # for contiguous masks starting at 0) is the plain mean of G_t over the rows active at t.
    gen = torch.Generator().manual_seed(4)
    lengths = [5, 5, 3, 4]
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(5)] for n in lengths], dtype=torch.float64)
    rewards = torch.randn(4, 5, generator=gen, dtype=torch.float64) * mask
    adv = compute_advantages("otb", make_inputs(rewards, mask, [0] * 4, w=torch.full_like(rewards, 0.2)))
    G = rewards.flip(1).cumsum(1).flip(1)
    active = mask.bool()
    for t in range(5):
        rows = active[:, t]
        expected = G[rows, t] - (G[rows, t].mean() if rows.sum() > 1 else 0.0)
        # OTB_EPS shift: |b| eps / sum W with |b| <~ 2, sum W >= 0.4: <~ 5e-8 (measured 1e-9); 1e-6 is 20x
        torch.testing.assert_close(adv[rows, t], expected, atol=1e-6, rtol=0)


def test_rloo_is_grpo_times_n_over_n_minus_1():
    for n in (2, 3, 5):
        rewards, mask, ids = equal_length_outcome_batch(n, n=n)
        inputs = make_inputs(rewards, mask, ids)
        torch.testing.assert_close(
            compute_advantages("rloo", inputs), compute_advantages("grpo", inputs) * n / (n - 1)
        )


def test_opo_equal_lengths_is_grpo():
    rewards, mask, ids = equal_length_outcome_batch(1)
    inputs = make_inputs(rewards, mask, ids)
    torch.testing.assert_close(compute_advantages("opo", inputs), compute_advantages("grpo", inputs))


def test_exact_optimal_with_proxy_norms_is_otb():
    rewards, mask, old_lp, sp2, groups = random_batch(9, tool_spans=True)
    w = logit_gradient_proxy(old_lp, sp2, mask)
    base = dict(old_log_probs=old_lp, sum_pi_squared=sp2)
    for multi_turn, name in ((False, "otb"), (True, "tir_otb")):
        otb_adv = compute_advantages(name, AdvantageInputs(rewards, mask, groups, **base))
        per_token = AdvantageInputs(rewards, mask, groups, grad_sq_norms=w)
        torch.testing.assert_close(
            compute_advantages("exact_optimal", per_token, cumulative=False, multi_turn=multi_turn), otb_adv
        )
        prefix = AdvantageInputs(rewards, mask, groups, grad_sq_norms=w.cumsum(1))
        torch.testing.assert_close(
            compute_advantages("exact_optimal", prefix, multi_turn=multi_turn), otb_adv
        )


def test_exact_optimal_sequence_norms_hand_computed():
    # classical b = sum ||g||^2 R / sum ||g||^2 = (1*1 + 3*0) / 4 = 0.25 on every token
    rewards = torch.tensor([[0, 1.0], [0, 0]], dtype=torch.float64)
    inputs = AdvantageInputs(rewards, torch.ones(2, 2), [0, 0], grad_sq_norms=torch.tensor([1.0, 3.0]))
    adv = compute_advantages("exact_optimal", inputs)
    torch.testing.assert_close(adv, torch.tensor([[0.75, 0.75], [-0.25, -0.25]], dtype=torch.float64))


def test_reinforce_is_otb_on_groups_of_one():
    rewards, mask, old_lp, sp2, _ = random_batch(12, tool_spans=True, dense=True)
    singletons = list(range(rewards.shape[0]))
    inputs = AdvantageInputs(rewards, mask, singletons, old_log_probs=old_lp, sum_pi_squared=sp2)
    torch.testing.assert_close(compute_advantages("reinforce", inputs), compute_advantages("otb", inputs))


# ---------------------------------------------------------------- group baselines: hand-computed


def test_grpo_rloo_opo_hand_computed():
    # one group, R = [1, 0, 1, 0], lengths 1, 2, 3, 2 (outcome reward on the last token)
    mask = [[1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 1, 0]]
    rewards = [[1.0, 0, 0], [0, 0, 0], [0, 0, 1.0], [0, 0, 0]]
    inputs = make_inputs(rewards, mask, ["q"] * 4)
    m = torch.tensor(mask, dtype=torch.float64)
    R = torch.tensor([1.0, 0, 1, 0], dtype=torch.float64)
    torch.testing.assert_close(compute_advantages("grpo", inputs), (R - 0.5)[:, None] * m)
    std = math.sqrt(1.0 / 3.0)  # unbiased: sum of squares 4 * 0.25 / (4 - 1)
    torch.testing.assert_close(
        compute_advantages("grpo", inputs, scale_by_std=True), ((R - 0.5) / (std + 1e-6))[:, None] * m
    )
    loo = torch.tensor([1 / 3, 2 / 3, 1 / 3, 2 / 3], dtype=torch.float64)  # mean of the other three
    torch.testing.assert_close(compute_advantages("rloo", inputs), (R - loo)[:, None] * m)
    b_opo = (1 * 1 + 3 * 1) / (1 + 2 + 3 + 2)  # sum L R / sum L = 0.5
    torch.testing.assert_close(compute_advantages("opo", inputs), (R - b_opo)[:, None] * m)
    torch.testing.assert_close(compute_advantages("reinforce", inputs), R[:, None] * m)


@pytest.mark.parametrize("name", ["grpo", "rloo", "opo"])
def test_group_baselines_group_of_one(name):
    inputs = make_inputs([[0, 2.0], [0, 1.0]], [[1, 1], [1, 1]], ["a", "b"])
    torch.testing.assert_close(
        compute_advantages(name, inputs), torch.tensor([[2.0, 2.0], [1.0, 1.0]], dtype=torch.float64)
    )


# ---------------------------------------------------------------- registry and input validation


def test_registry_lists_every_estimator():
    assert set(ALL) <= set(available_estimators())
    assert required_inputs("otb") == ("old_log_probs", "sum_pi_squared")
    assert required_inputs("grpo") == ()


def test_duplicate_registration_raises():
    with pytest.raises(ValueError, match="already registered"):

        @register_estimator("grpo")
        def again(inputs):  # pragma: no cover - never runs
            return inputs.token_rewards


def test_registered_custom_estimator_runs_and_unregisters():
    @register_estimator("test_zero")
    def zero(inputs, *, scale: float = 1.0):
        return inputs.token_rewards * 0 * scale

    try:
        out = compute_advantages("test_zero", make_inputs([[1.0]], [[1]], [0]), scale=2.0)
        assert out.eq(0).all()
    finally:
        unregister_estimator("test_zero")
    assert "test_zero" not in available_estimators()


def test_unknown_name_lists_valid_ones():
    with pytest.raises(KeyError, match=r"valid names: .*grpo.*otb"):
        compute_advantages("gpro", make_inputs([[1.0]], [[1]], [0]))


def test_unknown_option_is_rejected_with_accepted_list():
    with pytest.raises(TypeError, match="accepts: \\['scale_by_std', 'std_eps'\\]"):
        compute_advantages("grpo", make_inputs([[1.0]], [[1]], [0]), norm_adv=True)


def test_missing_required_input_names_the_field():
    inputs = AdvantageInputs(torch.ones(1, 2), torch.ones(1, 2), [0])
    with pytest.raises(ValueError, match="old_log_probs, sum_pi_squared"):
        compute_advantages("otb", inputs)
    with pytest.raises(ValueError, match="grad_sq_norms"):
        compute_advantages("exact_optimal", inputs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            dict(token_rewards=torch.zeros(2, 3), response_mask=torch.ones(2, 4), group_index=[0, 0]),
            "response_mask",
        ),
        (
            dict(token_rewards=torch.zeros(2, 3), response_mask=torch.ones(2, 3), group_index=[0]),
            "group_index",
        ),
        (dict(token_rewards=torch.zeros(3), response_mask=torch.ones(3), group_index=[0, 0, 0]), r"\(B, L\)"),
        (
            dict(
                token_rewards=torch.zeros(2, 3),
                response_mask=torch.ones(2, 3),
                group_index=[0, 0],
                sum_pi_squared=torch.ones(2, 2),
            ),
            "sum_pi_squared",
        ),
        (
            dict(
                token_rewards=torch.tensor([[0, 0, 1.0]]),
                response_mask=torch.tensor([[1, 1, 0]]),
                group_index=[0],
            ),
            "last policy token",
        ),
        (
            dict(
                token_rewards=torch.zeros(2, 3),
                response_mask=torch.ones(2, 3),
                group_index=[0, 0],
                valid=torch.ones(3, dtype=torch.bool),
            ),
            "valid",
        ),
    ],
)
def test_bad_inputs_raise_with_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdvantageInputs(**kwargs)
