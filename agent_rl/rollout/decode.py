"""Decoding a policy turn for the env: special tokens dropped, except those that open a tool call.

The collector hands the env the text of what the policy sampled, decoded with
`skip_special_tokens=True` so that the end-of-turn token and other control tokens do not reach the
parser. Llama 3.x and Mistral, though, open a tool call with a special token: `<|python_tag|>`
(optional for Llama's JSON calls) and Mistral's `[TOOL_CALLS]` (and, from tokenizer v11,
`[ARGS]` and `[CALL_ID]`). Dropping `[TOOL_CALLS]` would turn every Mistral call into prose, so these
markers are kept (what vLLM's tool parsers get by decoding with `skip_special_tokens=False`).
A turn without a marker decodes exactly as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

TOOL_CALL_MARKERS = ("<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")


def marker_ids(tokenizer: Any) -> dict[int, str]:
    """The tokenizer's single-token ids of the tool-call markers it has (none for Qwen's, whose
    `<tool_call>` is not special and survives decoding anyway)."""
    found: dict[int, str] = {}
    get_vocab = getattr(tokenizer, "get_vocab", None)  # test doubles may have none
    vocab = get_vocab() if callable(get_vocab) else {}
    for marker in TOOL_CALL_MARKERS:
        tid = vocab.get(marker)
        if tid is not None:
            found[int(tid)] = marker
    return found


def decode_turn(tokenizer: Any, ids: Sequence[int], markers: dict[int, str]) -> str:
    """`ids` decoded with special tokens skipped, the tool-call `markers` (from `marker_ids`) kept
    as their text. The runs between markers are decoded separately: exact for byte-level BPE (Llama 3,
    Tekken), since a marker is a whole token and splits no character; a SentencePiece decoder may drop
    a space right after a marker, which the parsers ignore."""
    if not markers or not any(t in markers for t in ids):
        return tokenizer.decode(list(ids), skip_special_tokens=True)
    parts: list[str] = []
    run: list[int] = []
    for tid in ids:
        if tid in markers:
            parts.append(tokenizer.decode(run, skip_special_tokens=True))
            parts.append(markers[tid])
            run = []
        else:
            run.append(tid)
    parts.append(tokenizer.decode(run, skip_special_tokens=True))
    return "".join(parts)
