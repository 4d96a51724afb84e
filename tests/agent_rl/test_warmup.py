from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from agent_rl.tiny_model import load_model_and_tokenizer  # noqa: E402
from agent_rl.warmup import run_warmup, tokenize_conversation  # noqa: E402

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
    assert losses[-1] < 0.5 * losses[0]
