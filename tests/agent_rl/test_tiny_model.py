from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from agent_rl.build import load_model_and_tokenizer  # noqa: E402
from agent_rl.cli import main as cli_main  # noqa: E402
from agent_rl.tiny_model import TinyModelSpec, build_tokenizer  # noqa: E402


def test_loads_through_auto_classes_and_generates(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen2"
    assert cfg["hidden_size"] // cfg["num_attention_heads"] >= 32  # vLLM CPU attention
    msgs = [
        {"role": "system", "content": "Use python."},
        {"role": "user", "content": "What is 2**10?"},
        {"role": "assistant", "content": "```python\nprint(2**10)\n```"},
        {"role": "tool", "content": "1024"},
    ]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]
    text = tok.decode(ids)
    for role in ("system", "user", "assistant", "tool"):
        assert f"<|im_start|>{role}\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    torch.manual_seed(0)
    out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=True)
    assert out.shape[1] > len(ids)


def test_tokenizer_round_trips_printable_ascii_and_more() -> None:
    tok = build_tokenizer()
    import string

    for text in [string.printable, "x = 41\nprint(x + 1)\n", "naïve ∑ 🙂", "\\boxed{12}"]:
        assert tok.decode(tok.encode(text)) == text
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert len(tok.encode(special)) == 1


def test_build_is_deterministic(tmp_path: Path) -> None:
    small = ["--hidden-size", "32", "--heads", "1", "--layers", "1"]
    assert cli_main(["tiny-model", str(tmp_path / "a"), *small]) == 0
    assert cli_main(["tiny-model", str(tmp_path / "b"), *small]) == 0
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    model, tok = load_model_and_tokenizer(tmp_path / "a")
    assert model.config.hidden_size == 32 and tok.pad_token_id is not None


def test_spec_defaults_suit_vllm_cpu() -> None:
    spec = TinyModelSpec()
    assert spec.hidden_size // spec.num_heads in (32, 64, 80) or spec.hidden_size // spec.num_heads > 80
