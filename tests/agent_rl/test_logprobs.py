"""Chunked log-probs / entropy / sum p^2 against a naive full softmax: values and gradients.

Tolerances (float32 unless stated). Chunked and naive paths compute the same logits and then reduce
over the vocabulary in different orders and chunk shapes, so values differ by a few ulp of their
magnitude (|log p|, entropy <= ~15 here: ulp <= 1e-6; measured max 1.9e-6 under AVX2 and AVX-512),
so atol 1e-5 leaves 5x, while a wrong normaliser, temperature or target index moves them by >= 1e-2.
Gradients also sum over chunk rows and the vocabulary (~10^2 terms: ~1e2 x 2^-24 ~ 6e-6 relative),
hence rtol 1e-5, and 1e-4 for the model's gradients, which also sum over 18 positions and two layers;
atol 1e-5 for entries near 0 (measured max 4.8e-6 and 1.7e-6: <= 15% of the tolerance, both paths).
"""

from __future__ import annotations

import pytest
import torch

from agent_rl.logprobs import causal_lm_token_stats, token_stats_from_hidden


def naive_stats(hidden, weight, targets, bias=None, temperature=1.0):
    logits = torch.nn.functional.linear(hidden, weight, bias)  # (..., V) as the model's nn.Linear head
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    log_p = torch.log_softmax(z, dim=-1)
    p = log_p.exp()
    return (
        log_p.gather(-1, targets[..., None]).squeeze(-1),
        -(p * log_p).sum(-1),
        p.square().sum(-1),
    )


def make_head(seed=0, B=3, L=9, H=16, V=40, scale=0.5, bias=True, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(B, L, H, generator=gen) * scale).to(dtype).requires_grad_()
    weight = torch.randn(V, H, generator=gen).to(dtype).requires_grad_()
    b = torch.randn(V, generator=gen).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, V, (B, L), generator=gen)
    return hidden, weight, b, targets


@pytest.mark.parametrize("chunk_size", [1, 4, 27, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("bias", [False, True])
def test_values_match_naive_softmax(chunk_size, temperature, bias):
    hidden, weight, b, targets = make_head(bias=bias)
    stats = token_stats_from_hidden(
        hidden, weight, targets, bias=b, temperature=temperature, chunk_size=chunk_size
    )
    lp, ent, sp2 = naive_stats(hidden, weight, targets, b, temperature)
    assert stats.log_probs.shape == targets.shape
    torch.testing.assert_close(stats.log_probs, lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(stats.entropy, ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(stats.sum_pi_squared, sp2, atol=1e-5, rtol=0)


def test_sum_pi_squared_logsumexp_path_without_entropy_and_extreme_logits():
    # logits in the thousands: a direct exp(2 z) would overflow even in float64 (exp(709) is the limit).
    # float64 tolerance: if the 5-row and the full matmul summed the 16 products x w (each <= ~500) in
    # different orders, z would move by <= 16 x 500 x 2^-53 ~ 1e-12 and sum p^2 by at most twice that.
    # Measured 2e-16 (one ulp) under AVX2 and AVX-512; atol 1e-10 covers the worst case 50x and is
    # still ~1e5 below float32 rounding. (It was 1e-12: inside the worst case.)
    hidden, weight, b, targets = make_head(scale=60.0, dtype=torch.float64)
    assert (hidden @ weight.T).abs().max() > 400
    stats = token_stats_from_hidden(hidden, weight, targets, bias=b, with_entropy=False, chunk_size=5)
    assert stats.entropy is None
    _, _, sp2 = naive_stats(hidden, weight, targets, b)
    torch.testing.assert_close(stats.sum_pi_squared, sp2, atol=1e-10, rtol=0)
    both = token_stats_from_hidden(hidden, weight, targets, bias=b, chunk_size=5)
    # same chunks, same kernel, same exp pass (entropy is computed after sum p^2): measured bitwise
    torch.testing.assert_close(both.sum_pi_squared, stats.sum_pi_squared, atol=1e-12, rtol=0)
    low = token_stats_from_hidden(hidden.float(), weight.float(), targets, bias=b.float(), with_entropy=False)
    assert torch.isfinite(low.sum_pi_squared).all()
    # sum e^2 / (sum e)^2 <= 1 exactly in real arithmetic (e >= 0, max e = 1); float32 adds ~6 roundings
    # (two sums, sqrt, two squares, a division): <= 6 x 2^-24 ~ 3.6e-7 above 1, so 1e-6 leaves ~3x
    assert ((low.sum_pi_squared > 0) & (low.sum_pi_squared <= 1 + 1e-6)).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("use", ["log_probs", "entropy", "both"])
def test_gradients_match_naive_softmax(temperature, use):
    hidden, weight, b, targets = make_head(seed=1)
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(targets.shape, generator=gen)
    c = torch.randn(targets.shape, generator=gen)

    def objective(lp, ent):
        terms = {"log_probs": (a * lp).sum(), "entropy": (c * ent).sum()}
        return terms["log_probs"] + terms["entropy"] if use == "both" else terms[use]

    stats = token_stats_from_hidden(hidden, weight, targets, bias=b, temperature=temperature, chunk_size=5)
    got = torch.autograd.grad(objective(stats.log_probs, stats.entropy), (hidden, weight, b))
    lp, ent, _ = naive_stats(hidden, weight, targets, b, temperature)
    want = torch.autograd.grad(objective(lp, ent), (hidden, weight, b))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_gradcheck_float64():
    hidden, weight, b, targets = make_head(seed=3, B=2, L=5, H=6, V=11, dtype=torch.float64)

    def fn(h, w, bb):
        s = token_stats_from_hidden(h, w, targets, bias=bb, temperature=0.8, chunk_size=3)
        return s.log_probs, s.entropy

    assert torch.autograd.gradcheck(fn, (hidden, weight, b))


def test_no_grad_path_and_detached_sum_pi_squared():
    hidden, weight, b, targets = make_head()
    with torch.no_grad():
        plain = token_stats_from_hidden(hidden, weight, targets, bias=b, chunk_size=4)
    tracked = token_stats_from_hidden(hidden, weight, targets, bias=b, chunk_size=4)
    assert not plain.log_probs.requires_grad and tracked.log_probs.requires_grad
    assert not tracked.sum_pi_squared.requires_grad
    # same kernel, same inputs, same chunks: bitwise (grad mode only decides what is saved)
    torch.testing.assert_close(plain.log_probs, tracked.log_probs.detach(), atol=0, rtol=0)


def test_bfloat16_model_statistics_are_float32_and_close():
    hidden, weight, b, targets = make_head(dtype=torch.bfloat16, scale=1.0)
    stats = token_stats_from_hidden(hidden, weight, targets, bias=b, chunk_size=7)
    assert stats.log_probs.dtype == torch.float32
    lp, ent, sp2 = naive_stats(hidden, weight, targets, b)
    # both sides upcast the same bfloat16 logits (nn.functional.linear of the same rows, a 16-term dot
    # product), so only the float32 softmax differs: as above
    torch.testing.assert_close(stats.log_probs, lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(stats.entropy, ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(stats.sum_pi_squared, sp2, atol=1e-5, rtol=0)
    stats.log_probs.sum().backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16


def test_backward_never_saves_a_full_logits_tensor():
    # The property the chunking exists for: autograd keeps nothing of size (N x V).
    hidden, weight, b, targets = make_head(B=4, L=32, H=8, V=300)
    n_tokens, vocab = targets.numel(), weight.shape[0]
    saved: list[int] = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stats = token_stats_from_hidden(hidden, weight, targets, bias=b, chunk_size=16)
        stats.log_probs.sum().backward()
    assert saved, "the custom function must save its inputs"
    assert max(saved) < n_tokens * vocab / 4
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        naive_stats(hidden, weight, targets, b)
    assert max(saved) >= n_tokens * vocab  # sanity: the naive path does save full logits


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(temperature=0.0), "temperature"),
        (dict(chunk_size=0), "chunk_size"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    hidden, weight, _, targets = make_head()
    with pytest.raises(ValueError, match=match):
        token_stats_from_hidden(hidden, weight, targets, **kwargs)


def test_bad_targets_and_shapes_raise():
    hidden, weight, _, targets = make_head(V=40)
    with pytest.raises(ValueError, match="token ids"):
        token_stats_from_hidden(hidden, weight, targets + 40)
    with pytest.raises(ValueError, match="leading dims"):
        token_stats_from_hidden(hidden, weight, targets[:, :-1])
    with pytest.raises(ValueError, match="weight must be"):
        token_stats_from_hidden(hidden, weight[:, :-1], targets)


# ---------------------------------------------------------------- real HF model (tiny Qwen2, tied embeddings)


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from agent_rl.build import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(tiny_model_dir)
    return model


def test_causal_lm_stats_match_model_logits(tiny_model):
    model = tiny_model
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (3, 14), generator=gen)
    attention = torch.ones_like(ids)
    attention[1, :4] = 0  # left padding
    stats = causal_lm_token_stats(model, ids, attention, response_length=6, temperature=0.9, chunk_size=5)
    positions = (attention.cumsum(-1) - 1).clamp_min(0)  # left padding: generation's positions
    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits[:, -7:-1]
    lp, ent, sp2 = naive_stats_from_logits(logits, ids[:, -6:], 0.9)
    torch.testing.assert_close(stats.log_probs, lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(stats.entropy, ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(stats.sum_pi_squared, sp2, atol=1e-5, rtol=0)
    params = [p for p in model.parameters() if p.requires_grad]
    got = torch.autograd.grad(stats.log_probs.sum() + 0.1 * stats.entropy.sum(), params)
    want = torch.autograd.grad(lp.sum() + 0.1 * ent.sum(), params)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


def naive_stats_from_logits(logits, targets, temperature):
    log_p = torch.log_softmax(logits.float() / temperature, dim=-1)
    p = log_p.exp()
    return log_p.gather(-1, targets[..., None]).squeeze(-1), -(p * log_p).sum(-1), p.square().sum(-1)


def test_causal_lm_left_padding_matches_the_unpadded_row(tiny_model):
    ids = torch.randint(0, tiny_model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    attention = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 9, dtype=torch.long)], dim=1)
    alone = causal_lm_token_stats(tiny_model, ids, response_length=5)
    with_pad = causal_lm_token_stats(tiny_model, padded, attention, response_length=5)
    # padding changes the attention matmuls' shapes (12 vs 9 keys): float32 re-association through two
    # layers, |log p| ~ 6 (vocab 373): a few ulp ~ 1e-6 (measured 4.8e-7); atol 1e-5 as above
    torch.testing.assert_close(with_pad.log_probs, alone.log_probs, atol=1e-5, rtol=0)
    torch.testing.assert_close(with_pad.sum_pi_squared, alone.sum_pi_squared, atol=1e-5, rtol=0)


def test_causal_lm_rejects_bad_response_length(tiny_model):
    ids = torch.zeros(1, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="response_length"):
        causal_lm_token_stats(tiny_model, ids, response_length=5)
    full = causal_lm_token_stats(tiny_model, ids)
    assert full.log_probs.shape == (1, 4)


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("use", ["log_probs", "entropy", "both", "no_entropy"])
def test_row_blocks_give_the_whole_chunk_results(monkeypatch, rows, use):
    """The elementwise passes run a few rows at a time (cache-sized at real vocabularies). Each row's
    arithmetic does not depend on the block, so values and gradients with 1-, 3- and 64-row blocks
    match one block per chunk to a few ulp (rtol 1e-6: measured equal bit for bit here), and the
    naive softmax within the tolerances above."""
    from agent_rl import logprobs

    hidden, weight, b, targets = make_head(seed=4, B=2, L=11, H=16, V=500)
    gen = torch.Generator().manual_seed(5)
    a, c = torch.randn(targets.shape, generator=gen), torch.randn(targets.shape, generator=gen)

    def run(block_rows: int):
        monkeypatch.setitem(logprobs.ROW_BLOCK_BYTES, "cpu", block_rows * 500 * 4)
        stats = token_stats_from_hidden(
            hidden, weight, targets, bias=b, temperature=0.8, chunk_size=8, with_entropy=use != "no_entropy"
        )
        if use == "no_entropy":  # the backward branch without an entropy term at all
            grads = torch.autograd.grad((a * stats.log_probs).sum(), (hidden, weight, b))
            return (stats.log_probs, stats.sum_pi_squared, *grads)
        terms = {"log_probs": (a * stats.log_probs).sum(), "entropy": (c * stats.entropy).sum()}
        objective = terms["log_probs"] + terms["entropy"] if use == "both" else terms[use]
        grads = torch.autograd.grad(objective, (hidden, weight, b))
        return (stats.log_probs, stats.entropy, stats.sum_pi_squared, *grads)

    blocked, whole = run(rows), run(10_000)
    for got, want in zip(blocked, whole, strict=True):
        torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-6)
    lp, ent, sp2 = naive_stats(hidden.detach(), weight.detach(), targets, b.detach(), 0.8)
    expected = (lp, sp2) if use == "no_entropy" else (lp, ent, sp2)
    for got, want in zip(blocked[: len(expected)], expected, strict=True):
        torch.testing.assert_close(got.detach(), want, atol=1e-5, rtol=0)


def test_entropy_used_only_as_a_metric_costs_no_backward(monkeypatch):
    """The learner always takes the entropy (a logged metric) but backpropagates it only when
    entropy_coef > 0. An output the loss does not use must reach backward as None, not as a
    tensor of zeros, or the head computes the entropy's gradient (-p (log p + H), an extra pass
    over every logit) for nothing."""
    from agent_rl import logprobs

    seen: list[bool] = []
    original = logprobs._logit_grads_by_row_block

    def spy(z, target, lse, grad_log_probs, entropy, grad_entropy):
        seen.append(grad_entropy is not None)
        return original(z, target, lse, grad_log_probs, entropy, grad_entropy)

    monkeypatch.setattr(logprobs, "_logit_grads_by_row_block", spy)
    hidden, weight, b, targets = make_head(seed=6)
    stats = token_stats_from_hidden(hidden, weight, targets, bias=b, chunk_size=9)
    metric = stats.entropy.mean().item()  # logged, not in the loss
    got = torch.autograd.grad(stats.log_probs.sum(), (hidden, weight, b))
    assert seen == [False] * 3 and metric > 0
    lp, _, _ = naive_stats(hidden, weight, targets, b)
    for g, w in zip(got, torch.autograd.grad(lp.sum(), (hidden, weight, b)), strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    seen.clear()
    stats = token_stats_from_hidden(hidden, weight, targets, bias=b, chunk_size=9)
    torch.autograd.grad(stats.log_probs.sum() + 0.1 * stats.entropy.sum(), (hidden, weight, b))
    assert seen == [True] * 3
