"""The contract every engine fulfils, run against HFEngine and VLLMEngine alike."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from agent_rl.rollout.engine import Engine, SamplingParams

PROMPTS = [
    [1, 87, 85, 294, 201, 298, 2, 201, 1, 67],
    [1, 40, 41],
    [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
]


def trainer_log_probs(model: Any, prompt: list[int], ids: list[int], temperature: float) -> torch.Tensor:
    """What the learner computes: one forward pass over prompt + sampled ids, log_softmax(logits / T)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0].float()  # (L, V)
    scores = logits[len(prompt) - 1 : -1] / temperature  # (R, V) predicts each sampled id
    return scores.log_softmax(-1).gather(-1, torch.tensor(ids)[:, None])[:, 0]


def test_engines_satisfy_protocol(engine: Any) -> None:
    assert isinstance(engine, Engine)


def test_shapes_and_finish_reasons(engine: Any, tokenizer: Any) -> None:
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=1)
    outs = engine.generate(PROMPTS, params)
    assert len(outs) == len(PROMPTS)
    for out in outs:
        assert 1 <= len(out.token_ids) <= 12
        assert len(out.log_probs) == len(out.token_ids)
        assert all(lp <= 0.0 for lp in out.log_probs)
        if out.finish_reason == "length":
            assert len(out.token_ids) == 12
            assert engine.eos_token_id not in out.token_ids
        else:
            assert out.token_ids[-1] == engine.eos_token_id
            assert engine.eos_token_id not in out.token_ids[:-1]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_match_trainer_forward(
    engine: Any, reference_model: Any, tolerance: float, temperature: float
) -> None:
    outs = engine.generate(PROMPTS, SamplingParams(temperature=temperature, max_new_tokens=40, seed=7))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        recomputed = trainer_log_probs(reference_model, prompt, out.token_ids, temperature)
        sampled = torch.tensor(out.log_probs)
        assert torch.allclose(recomputed, sampled, atol=tolerance, rtol=0), (recomputed - sampled).abs().max()


def test_top_p_log_probs_are_renormalised_over_the_nucleus(
    engine: Any, reference_model: Any, tolerance: float
) -> None:
    temperature, top_p = 0.9, 0.6
    outs = engine.generate(
        PROMPTS, SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=30, seed=3)
    )
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            logits = reference_model(torch.tensor([prompt + out.token_ids])).logits[0].float()
        for t, (tok, lp) in enumerate(zip(out.token_ids, out.log_probs, strict=True)):
            probs = (logits[len(prompt) - 1 + t] / temperature).softmax(-1)
            # Nucleus: tokens whose strictly-more-likely mass is below top_p.
            before = torch.tensor([probs[probs > p].sum() for p in probs])
            nucleus = before < top_p
            assert nucleus[tok], f"token {tok} at step {t} was sampled from outside the nucleus"
            expected = torch.log(probs[tok] / probs[nucleus].sum())
            # the reference itself renormalises in float32 over up to 373 probabilities (<= 373 x 2^-24
            # ~ 2e-5 in log) on top of the engine's error: 5x the engine tolerance, >= 5e-4
            assert abs(float(expected) - lp) < max(tolerance, 1e-4) * 5


def test_greedy_is_argmax_with_untempered_log_probs(
    engine: Any, reference_model: Any, tolerance: float
) -> None:
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=20))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            logits = reference_model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
        assert out.token_ids == logits.argmax(-1).tolist()
        recomputed = trainer_log_probs(reference_model, prompt, out.token_ids, 1.0)
        assert torch.allclose(recomputed, torch.tensor(out.log_probs), atol=tolerance, rtol=0)


def test_seed_reproducible_and_independent_of_batch(engine: Any) -> None:
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=11)
    batched = engine.generate(PROMPTS, params)
    alone = engine.generate([PROMPTS[1]], params)
    assert alone[0].token_ids == batched[1].token_ids
    other_seed = engine.generate([PROMPTS[1]] * 3, [params.with_(seed=s) for s in (12, 13, 14)])
    assert any(o.token_ids != alone[0].token_ids for o in other_seed)


def test_stop_token_ids_end_generation_and_are_kept(engine: Any) -> None:
    greedy = engine.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_new_tokens=20))[0].token_ids
    stop_id = greedy[3]
    first = greedy.index(stop_id)
    out = engine.generate(
        [PROMPTS[2]], SamplingParams(temperature=0.0, max_new_tokens=20, stop_token_ids=[stop_id])
    )[0]
    assert out.token_ids == greedy[: first + 1]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop_id


def test_stop_string_ends_on_the_completing_token(engine: Any, tokenizer: Any) -> None:
    greedy = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=24))[0].token_ids
    text = tokenizer.decode(greedy, skip_special_tokens=False)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), "pick a visible stop string"
    out = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=24, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.token_ids == greedy[: len(out.token_ids)]  # ids exactly as sampled, nothing trimmed
    assert stop in tokenizer.decode(out.token_ids, skip_special_tokens=False)
    assert stop not in tokenizer.decode(out.token_ids[:-1], skip_special_tokens=False)


def test_update_weights_in_place(engine: Any, reference_model: Any, tolerance: float) -> None:
    original = {k: v.clone() for k, v in reference_model.state_dict().items()}
    before = engine.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_new_tokens=16))[0]
    generator = torch.Generator().manual_seed(0)
    perturbed = {
        k: v + 0.5 * torch.randn(v.shape, generator=generator) * v.std() if v.ndim == 2 else v
        for k, v in original.items()
    }
    # The trainer's tied model: its state dict names lm_head.weight and the embeddings as one tensor.
    perturbed["lm_head.weight"] = perturbed["model.embed_tokens.weight"]
    try:
        reference_model.load_state_dict(perturbed)
        engine.update_weights(reference_model.state_dict())
        after = engine.generate([PROMPTS[1]], SamplingParams(temperature=1.0, max_new_tokens=16, seed=5))[0]
        recomputed = trainer_log_probs(reference_model, PROMPTS[1], after.token_ids, 1.0)
        assert torch.allclose(recomputed, torch.tensor(after.log_probs), atol=tolerance, rtol=0)
    finally:
        reference_model.load_state_dict(original)
        engine.update_weights(reference_model.state_dict())
    restored = engine.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_new_tokens=16))[0]
    assert restored.token_ids == before.token_ids


def test_bad_requests_fail_clearly(engine: Any) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([[1] * engine.max_model_len], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="SamplingParams"):
        engine.generate(PROMPTS, [SamplingParams()])
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
