"""The partial-selection nucleus filter keeps the tokens the nucleus definition keeps, like a sort."""

from __future__ import annotations

import pytest
import torch

from agent_rl.rollout import hf_engine
from agent_rl.rollout.hf_engine import draw, top_p_filter, top_p_filter_by_sort


def random_logits(rows: int, vocab: int, seed: int, scale: float) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((rows, vocab), generator=generator) * scale  # (B, V), ties have probability ~0


def exact_nucleus(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """(B, V) bool: tokens whose strictly-more-likely mass is below top_p, in float64 throughout."""
    probs = logits.double().softmax(-1)
    sorted_probs, order = probs.sort(-1, descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    keep_sorted = mass_before < top_p[:, None].double()
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def boundary_mass(logits: torch.Tensor, kept: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """(B,) probability of the tokens on which two nuclei disagree."""
    return (logits.double().softmax(-1) * (kept ^ reference)).sum(-1)


@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0])  # flat (nucleus of 100k) to peaked (a few tokens)
def test_nucleus_matches_the_definition_at_a_real_vocabulary(scale: float) -> None:
    logits = random_logits(6, 152_064, seed=int(scale * 10), scale=scale)
    top_p = torch.tensor([0.1, 0.5, 0.9, 0.95, 0.999, 1.0])
    fast = top_p_filter(logits, top_p)
    kept, exact = fast.isfinite(), exact_nucleus(logits, top_p)
    # Float32 probabilities (relative error ~1e-7) may move the boundary by a token or a run of
    # tail tokens whose cumulative mass sits within rounding of top_p: measured <= 1.3e-5 of mass
    # here, as for the sorting filter (<= 1.3e-5). A real error (an off-by-one nucleus, a wrong
    # tie rule) moves >= 1e-3 at these scales.
    assert (boundary_mass(logits, kept, exact) < 1e-4).all()
    assert (boundary_mass(logits, top_p_filter_by_sort(logits, top_p).isfinite(), exact)[:-1] < 1e-4).all()
    assert torch.equal(fast[kept], logits[kept])  # kept logits are untouched
    assert (kept[:-1].sum(-1) < logits.shape[-1]).all()
    assert torch.equal(fast[-1], logits[-1])  # top_p = 1 keeps the whole vocabulary


def test_peaked_rows_agree_with_the_sorting_filter_exactly() -> None:
    logits = random_logits(4, 152_064, seed=2, scale=8.0)
    top_p = torch.tensor([0.3, 0.6, 0.9, 0.95])
    assert torch.equal(top_p_filter(logits, top_p), top_p_filter_by_sort(logits, top_p))


def test_nucleus_larger_than_every_first_guess_grows_k(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf_engine, "TOP_P_FIRST_K", 2)
    logits = random_logits(3, 1000, seed=1, scale=0.3)  # nucleus of hundreds: k grows 2 -> 32 -> 1000
    top_p = torch.tensor([0.3, 0.9, 0.99])
    assert torch.equal(top_p_filter(logits, top_p).isfinite(), exact_nucleus(logits, top_p))


def test_top_p_one_returns_the_input_without_work() -> None:
    logits = random_logits(2, 100, seed=0, scale=1.0)
    assert top_p_filter(logits, torch.ones(2)) is logits


def test_ties_at_the_boundary_stay_together() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2]]))
    # Strictly-more-likely mass is 0.4 for each 0.2 token, below 0.5: all three are in the nucleus.
    assert top_p_filter(logits, torch.tensor([0.5])).isfinite().all()
    assert top_p_filter(logits, torch.tensor([0.4])).isfinite().tolist() == [[True, False, False, False]]


def test_sampled_distribution_is_the_renormalised_nucleus() -> None:
    """The engine's draws through the filter follow p / nucleus mass on the nucleus, never outside."""
    logits = random_logits(1, 50, seed=3, scale=1.5)
    top_p = torch.tensor([0.8])
    probs = top_p_filter(logits, top_p).log_softmax(-1)[0].exp()
    generator = torch.Generator().manual_seed(0)
    draws = torch.tensor([draw(probs, generator) for _ in range(40_000)])
    freq = torch.bincount(draws, minlength=50).double() / draws.numel()
    nucleus = exact_nucleus(logits, top_p)[0]
    expected = logits[0].double().softmax(-1) * nucleus
    expected = expected / expected.sum()
    assert (freq[~nucleus] == 0).all()
    # 40k draws: the standard error of a frequency is <= 0.0025; 6 sigma.
    assert (freq - expected).abs().max() < 0.015


def test_draw_is_reproducible_per_generator_and_skips_zero_mass_tokens() -> None:
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0])
    first = [draw(probs, torch.Generator().manual_seed(s)) for s in range(200)]
    again = [draw(probs, torch.Generator().manual_seed(s)) for s in range(200)]
    assert first == again and set(first) == {1, 3}
    assert draw(torch.tensor([0.0, 0.0, 2.0]), torch.Generator().manual_seed(0)) == 2  # unnormalised is fine
