from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")

from agent_rl.build import load_model_and_tokenizer  # noqa: E402
from agent_rl.warmup import (  # noqa: E402
    Example,
    run_warmup,
    tokenize_conversation,
    turn_accuracies,
    turn_spans,
)

CONV = [
    {"role": "system", "content": "Use python."},
    {"role": "user", "content": "Compute 12 * 34."},
    {"role": "assistant", "content": "```python\nprint(12 * 34)\n```"},
    {"role": "tool", "content": "408"},
    {"role": "assistant", "content": "\\boxed{408}"},
]


def test_mask_covers_exactly_assistant_turns(tiny_model_dir) -> None:
    _, tok = load_model_and_tokenizer(tiny_model_dir)
    ex = tokenize_conversation(tok, CONV)
    assert len(ex.ids) == len(ex.mask)
    # the pieces concatenate to exactly the chat template's rendering
    assert tok.decode(ex.ids) == tok.apply_chat_template(CONV, tokenize=False)
    policy_text = tok.decode([i for i, m in zip(ex.ids, ex.mask) if m])
    assert policy_text == "```python\nprint(12 * 34)\n```<|im_end|>\\boxed{408}<|im_end|>"


def test_warmup_lowers_the_loss(tiny_model_dir) -> None:
    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer(tiny_model_dir)
    ex = tokenize_conversation(tok, CONV)
    losses = run_warmup(model, [ex], steps=30, batch_size=2, lr=3e-3, pad_id=tok.pad_token_id, seed=0)
    # measured 0.34 of the first loss (5.92 -> 2.03) under AVX2 and AVX-512 alike; 0.5 leaves room for
    # other kernels, while a warm-up that does not learn stays near 1
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("schedule", ["linear", "constant"])
def test_lr_schedule_linear_anneals_to_zero(tiny_model_dir, schedule: str) -> None:
    """With the linear schedule the last step is taken at about lr/steps, so the end point does not
    hinge on the noise of the last few full-rate steps."""
    model, tok = load_model_and_tokenizer(tiny_model_dir)
    ex = tokenize_conversation(tok, CONV)
    rates: list[float] = []
    real_step = torch.optim.AdamW.step

    def spy(opt, *args, **kwargs):
        rates.append(opt.param_groups[0]["lr"])
        return real_step(opt, *args, **kwargs)

    torch.optim.AdamW.step = spy
    try:
        run_warmup(
            model,
            [ex],
            steps=10,
            batch_size=1,
            lr=1e-3,
            pad_id=tok.pad_token_id,
            seed=0,
            lr_schedule=schedule,
        )
    finally:
        torch.optim.AdamW.step = real_step
    # the schedule is a few float64 products (~1e-16 relative): approx's default rel 1e-6 is ample
    assert len(rates) == 10 and rates[0] == pytest.approx(1e-3)
    if schedule == "linear":
        assert rates[-1] == pytest.approx(1e-4) and all(a > b for a, b in itertools.pairwise(rates))
    else:
        assert rates == [pytest.approx(1e-3)] * 10
    with pytest.raises(ValueError, match="lr_schedule"):
        run_warmup(model, [ex], steps=1, batch_size=1, lr=1e-3, pad_id=0, seed=0, lr_schedule="cosine")


@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.6, 0.99])
def test_flawed_demonstrations_are_the_fraction_spread_evenly(fraction: float) -> None:
    from agent_rl.warmup import is_flawed

    flags = [is_flawed(k, fraction) for k in range(1000)]
    for n in (10, 100, 1000):  # every prefix holds the fraction to within one demonstration
        assert abs(sum(flags[:n]) - n * fraction) < 1
    longest_run = max((len(r) for r in "".join("x" if f else " " for f in flags).split()), default=0)
    assert longest_run <= (1 if fraction <= 0.5 else int(1 / (1 - fraction)) + 1)


def test_clean_steps_draw_only_the_first_pool(tiny_model_dir) -> None:
    """The curriculum: the first `first_steps` batches hold only examples from `first`, later ones
    draw from every example (seen through which examples reach the loss)."""
    import agent_rl.warmup as warmup

    model, tok = load_model_and_tokenizer(tiny_model_dir)
    pool = [tokenize_conversation(tok, CONV) for _ in range(4)]
    seen: list[set[int]] = []
    real_loss = warmup.sft_loss

    def spy(model, batch, pad_id):
        seen.append({next(k for k, e in enumerate(pool) if e is b) for b in batch})
        return real_loss(model, batch, pad_id)

    warmup.sft_loss = spy
    try:
        run_warmup(
            model,
            pool,
            steps=12,
            batch_size=4,
            lr=1e-4,
            pad_id=tok.pad_token_id,
            seed=0,
            first=[1, 3],
            first_steps=6,
        )
    finally:
        warmup.sft_loss = real_loss
    assert all(s <= {1, 3} for s in seen[:6])
    assert set().union(*seen[6:]) - {1, 3}, "after the curriculum every example is drawn"
    with pytest.raises(ValueError, match="first_steps"):
        run_warmup(model, pool, steps=2, batch_size=1, lr=1e-4, pad_id=0, seed=0, first_steps=1)


def test_clean_shortest_keeps_the_shortest_correct_demonstrations() -> None:
    """The length curriculum: only correct demos, and of those the shortest share (ties in order)."""
    from agent_rl.config import WarmupConfig
    from agent_rl.warmup import clean_indices

    lengths = [9, 1, 5, 3, 7, 2, 4, 8, 6, 3]  # demos 1, 3, 5, 7, 9 are the flawed ones at 0.5
    demos = [Example(ids=[0] * n, mask=[1] * n) for n in lengths]
    every = WarmupConfig(hallucinate_fraction=0.5)
    assert clean_indices(demos, every) == [0, 2, 4, 6, 8]
    shortest = WarmupConfig(hallucinate_fraction=0.5, clean_shortest=0.4)
    assert clean_indices(demos, shortest) == [2, 6]  # lengths 5 and 4 of 9, 5, 7, 4, 6
    one = WarmupConfig(hallucinate_fraction=0.5, clean_shortest=0.01)
    assert clean_indices(demos, one) == [6]
    with pytest.raises(ValueError):
        WarmupConfig(clean_shortest=0)


def test_final_turn_accuracy_is_exact_greedy_reproduction(tiny_model_dir) -> None:
    """An example whose last turn is what the model generates greedily counts; one token off does not."""
    model, tok = load_model_and_tokenizer(tiny_model_dir)
    prompt = tokenize_conversation(tok, [*CONV[:4], {"role": "assistant", "content": ""}]).ids
    prompt = prompt[: len(prompt) - 2]  # up to the last assistant header, before its end-of-turn
    out = model.generate(
        input_ids=torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=5,
        do_sample=False,
        pad_token_id=tok.pad_token_id,
    )
    turn = out[0, len(prompt) :].tolist()
    assert len(turn) == 5
    earlier_turn = [0] * len(prompt)
    earlier_turn[3:6] = [1, 1, 1]  # an earlier assistant turn is context, not what is checked
    same = Example(prompt + turn, earlier_turn + [1] * 5)
    wrong = Example(prompt + turn[:-1] + [(turn[-1] + 1) % len(tok)], earlier_turn + [1] * 5)
    assert turn_accuracies(model, [same], tok.pad_token_id)["final_turn_accuracy"] == 1.0
    assert turn_accuracies(model, [same, wrong], tok.pad_token_id)["final_turn_accuracy"] == 0.5


def test_turn_accuracies_count_every_assistant_turn_and_the_final_one(tiny_model_dir) -> None:
    """Two assistant turns, each the model's own greedy continuation of the history: both count.
    Spoil the first turn's last token and the final turn still counts (it is checked given the
    demonstration's history), per-turn accuracy drops to 1/2; spoil the final one instead and the
    final-turn accuracy is 0 while per-turn is 1/2."""
    model, tok = load_model_and_tokenizer(tiny_model_dir)

    def greedy(ids: list[int], n: int) -> list[int]:
        out = model.generate(
            input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id,
        )  # fmt: skip
        return out[0, len(ids) :].tolist()

    context = tok.encode("user: go\n", add_special_tokens=False)
    first = greedy(context, 4)
    tool = tok.encode("tool: 42\n", add_special_tokens=False)
    assert len(first) == 4  # no end-of-sequence before the budget
    spoilt_first = [*first[:-1], (first[-1] + 1) % len(tok)]
    mask = [0] * len(context) + [1] * 4 + [0] * len(tool) + [1] * 4
    assert turn_spans(mask) == [(len(context), len(context) + 4), (len(mask) - 4, len(mask))]

    def example(turn1: list[int], spoil_final: bool) -> Example:
        history = context + turn1 + tool
        final = greedy(history, 4)
        if spoil_final:
            final = [*final[:-1], (final[-1] + 1) % len(tok)]
        return Example(history + final, mask)

    assert turn_accuracies(model, [example(first, False)], tok.pad_token_id) == {
        "final_turn_accuracy": 1.0,
        "turn_accuracy": 1.0,
    }
    assert turn_accuracies(model, [example(spoilt_first, False)], tok.pad_token_id) == {
        "final_turn_accuracy": 1.0,
        "turn_accuracy": 0.5,
    }
    assert turn_accuracies(model, [example(first, True)], tok.pad_token_id) == {
        "final_turn_accuracy": 0.0,
        "turn_accuracy": 0.5,
    }
