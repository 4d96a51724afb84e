"""An offline tiny-model kit: a real Qwen2 causal LM and a locally built tokenizer.

No model hub is reachable on our CI machines, yet tests, benchmarks and the quickstart need a
real model that transformers and vLLM both load. `build_tiny_model` makes one deterministically
from a config (no download), with a byte-level BPE tokenizer trained on a small synthetic corpus
(so every string round-trips) and a chat template with system, user, assistant and tool roles.
The loaders in the rest of the project only ever see a directory, so a real hub model path
works the same way.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen-style ChatML. Every message renders to "<|im_start|>{role}\n{content}<|im_end|>\n", so a
# conversation's rendering is append-only: the rollout relies on that only through the delta
# computation, which it checks (see agent_rl/rollout).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Sizes of the tiny model. Defaults are accepted by vLLM's CPU backend (head size >= 32)."""

    vocab_size: int = 512
    """Tokenizer vocabulary incl. 256 byte symbols and the special tokens."""
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 2
    """Head size = hidden_size / num_heads; vLLM CPU attention needs 32, 64, 80 or more."""
    intermediate_size: int = 128
    max_position_embeddings: int = 2048
    seed: int = 0
    tokenizer_version: int = 2
    """Bumped when the tokenizer recipe changes, so cached builds are rebuilt."""


def _corpus(seed: int, n: int = 3000) -> list[str]:
    """Synthetic text in the shape of tool-use transcripts, so BPE merges cover digits and code."""
    rng = random.Random(seed)
    words = [
        "print",
        "def",
        "return",
        "for",
        "in",
        "range",
        "import",
        "math",
        "sum",
        "pow",
        "len",
        "answer",
        "boxed",
        "The",
        "is",
        "result",
        "Let",
        "compute",
        "python",
        "output",
        "if",
        "else",
        "while",
        "True",
        "False",
        "None",
        "x",
        "y",
        "n",
        "%",
        "**",
        "==",
        "+",
        "-",
    ]
    out = []
    for _ in range(n):
        parts = [rng.choice(words) for _ in range(rng.randint(3, 12))]
        parts.append(str(rng.randint(0, 10 ** rng.randint(1, 12))))
        out.append(" ".join(parts))
        out.append(f"```python\nprint({rng.randint(0, 999)} * {rng.randint(0, 999)})\n```")
        out.append(f"```output\n{rng.randint(0, 10**6)}\n```\n\\boxed{{{rng.randint(0, 10**6)}}}")
    return out


def build_tokenizer(spec: TinyModelSpec = TinyModelSpec()):
    """A byte-level BPE tokenizer trained deterministically on the synthetic corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Single digits: a 2-layer model learns to copy numbers digit by digit far more easily than it
    # learns a BPE's arbitrary digit chunks, and tool use is mostly copying numbers in and out.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Build, save and return the directory of a tiny Qwen2 model and its tokenizer.

    Deterministic: the same spec gives bit-identical weights and the same vocabulary.
    """
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    saved_state = torch.random.get_rng_state()
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    torch.random.set_rng_state(saved_state)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "tiny_model_spec.json").write_text(json.dumps(_build_record(spec), indent=2))
    return out


def _build_record(spec: TinyModelSpec) -> dict[str, object]:
    """What a cached build must match: the spec, and the transformers major version that saved it
    (a folder saved by 5.x names tokenizer classes that 4.x cannot load)."""
    import transformers

    return {**asdict(spec), "transformers_major": int(transformers.__version__.split(".")[0])}


def ensure_tiny_model(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """`build_tiny_model` unless `out_dir` already holds a build of exactly this spec, saved by
    this major version of transformers."""
    out = Path(out_dir)
    marker = out / "tiny_model_spec.json"
    if not marker.exists() or json.loads(marker.read_text()) != _build_record(spec):
        build_tiny_model(out, spec)
    return out
