"""Sequence packing for the learner: a micro-batch's rows concatenated instead of padded.

Why: a collated batch pads every row to the longest prompt and the longest response, so one
8k-token episode among seven 500-token ones makes the forward and backward cost 8 x 8.5k tokens.
Packed, the rows' real tokens are laid end to end in one or a few packed rows of at most
`algo.pack_tokens` tokens (first-fit-decreasing; a row longer than the budget gets a packed row of
its own), and each packed row is one backbone forward of exactly its tokens, so the micro-batch
costs its real token count: no filler anywhere. The budget bounds one forward's length (with sdpa
and eager attention the mask is T x T, and the attention's work grows as T^2), not the
micro-batch's activation memory: every packed row's graph lives until the micro-batch's backward,
as before, but it now holds the real tokens instead of B x L.

How the sequences stay apart: each segment's position_ids restart at 0 and the backbone is called
with `attention_mask=None`. transformers (`masking_utils.find_packed_sequence_indices`, in the
5.x used here) then reads every restart of the positions as a sequence boundary and builds a block-diagonal
causal mask (sdpa, eager, flex) or variable-length attention (flash-attention), so no token
attends across segments and each segment sees exactly the positions it had alone. A 2D attention
mask would switch that detection off (silently mixing the sequences), which is why none is passed.

Only the positions that predict a real response token go through the LM head; their statistics
are scattered back to the padded (B, R) layout, with 0 at padding, so everything downstream
(advantages, the PPO loss, metrics) sees the same tensors as without packing. Positions off the
policy mask are never read downstream; the padded path leaves garbage there and this path zeros.

What is covered: left-padded prompts + right-padded responses as `agent_rl.batch.collate` makes
them (each row's real tokens contiguous, positions 0..n-1 over them), any HF decoder-only model
whose attention honours packed position_ids (checked by name, see PACKED_ATTENTION), LoRA (peft)
wrappers, gradient checkpointing. What is not: rows whose real tokens have holes (rejected), a
response token with no real token before it (rejected: nothing predicts it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agent_rl.logprobs import DEFAULT_CHUNK_SIZE, TokenStats, plain_linear_head, token_stats_from_hidden

__all__ = [
    "PACKED_ATTENTION",
    "PackedRows",
    "first_fit_decreasing",
    "pack_rows",
    "packed_token_stats",
]

PACKED_ATTENTION = frozenset({"sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3"})
"""Attention implementations whose transformers mask (or varlen kernel) separates packed sequences
by their position_ids. Another one would silently let sequences attend to each other."""


def first_fit_decreasing(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Bins of row indices whose lengths sum to at most `budget` (a longer row gets a bin alone).

    First-fit-decreasing: longest rows first, each into the first bin with room. Uses at most
    11/9 OPT + 1 bins; deterministic (ties keep row order), and each bin lists rows in the order
    they were placed.
    """
    if budget < 1:
        raise ValueError(f"pack budget must be >= 1 token; got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = int(lengths[i])
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(max(0, budget - n))
    return bins


@dataclass(frozen=True)
class PackedRows:
    """A micro-batch laid out packed, and where each response token's prediction lives in it."""

    input_ids: tuple[torch.Tensor, ...]
    """One (T_k,) long tensor per packed row: its segments end to end, no filler."""
    position_ids: tuple[torch.Tensor, ...]
    """(T_k,) long each: 0.. within each segment."""
    src: torch.Tensor
    """(M,) long: index, in the packed rows' tokens concatenated, of the hidden state that predicts
    each real response token."""
    dst: torch.Tensor
    """(M,) long: flat index (b * R + j) of that token in the padded (B, R) response layout."""
    targets: torch.Tensor
    """(M,) long: the response token ids."""
    bins: tuple[tuple[int, ...], ...]
    """Batch rows in each packed row, in segment order."""

    @property
    def processed_tokens(self) -> int:
        """Tokens the backbone runs over packed: the real tokens, nothing else."""
        return sum(int(t.numel()) for t in self.input_ids)


def _spans(attention_mask: torch.Tensor) -> tuple[list[int], list[int]]:
    """First real token and real-token count of each row; the real tokens must be contiguous."""
    mask = attention_mask.bool()
    lengths = mask.sum(1)  # (B,)
    starts = mask.long().argmax(1)  # (B,) first 1 (0 for an all-padding row)
    cols = torch.arange(mask.shape[1])
    inside = (cols[None] >= starts[:, None]) & (cols[None] < (starts + lengths)[:, None])  # (B, L)
    if not torch.equal(inside, mask):
        bad = int((inside != mask).any(1).nonzero()[0])
        raise ValueError(
            f"row {bad}: its real tokens (attention_mask == 1) are not contiguous; packing needs "
            "prompt and response back to back, as agent_rl.batch.collate lays them out"
        )
    return starts.tolist(), lengths.tolist()


def _check_positions(position_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
    """position_ids must count 0..n-1 over each row's (contiguous) real tokens: packing restarts them."""
    mask = attention_mask.bool()
    wrong = (position_ids.to(mask.device) != mask.long().cumsum(1) - 1) & mask  # (B, L)
    if wrong.any():
        i = int(wrong.any(1).nonzero()[0])
        raise ValueError(
            f"row {i}: position_ids over its real tokens must be 0..n-1 (as collate makes them); "
            "packing restarts them per sequence and cannot keep other positions"
        )


def pack_rows(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    budget: int,
    position_ids: torch.Tensor | None = None,
) -> PackedRows:
    """Lay the rows of a padded micro-batch end to end in packed rows of at most `budget` tokens.

    input_ids, attention_mask: (B, L), prompts left-padded and responses right-padded; the last
    `response_length` columns are the response. position_ids (optional) are only checked.
    """
    prompt_len = input_ids.shape[1] - int(response_length)
    starts, lengths = _spans(attention_mask.cpu())
    if position_ids is not None:
        _check_positions(position_ids.cpu(), attention_mask.cpu())
    bins = first_fit_decreasing(lengths, budget)
    cpu_ids = input_ids.cpu()
    ids: list[torch.Tensor] = []
    pos: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    dst: list[torch.Tensor] = []
    tgt: list[torch.Tensor] = []
    offset = 0  # tokens of the packed rows so far, all rows concatenated
    for rows in bins:
        for i in rows:
            s, n = starts[i], lengths[i]
            ids.append(cpu_ids[i, s : s + n])
            pos.append(torch.arange(n))
            cols = torch.arange(max(prompt_len, s), s + n)  # its real response tokens' columns
            if len(cols) and int(cols[0]) == s:
                raise ValueError(
                    f"row {i}: its first real token is a response token; no position predicts it"
                )
            src.append(offset + (cols - 1 - s))
            dst.append(i * response_length + (cols - prompt_len))
            tgt.append(cpu_ids[i, cols])
            offset += n
    sizes = [sum(lengths[i] for i in rows) for rows in bins]
    device = input_ids.device
    return PackedRows(
        input_ids=tuple(t.to(device) for t in torch.cat(ids).split(sizes)),
        position_ids=tuple(t.to(device) for t in torch.cat(pos).split(sizes)),
        src=torch.cat(src).to(device),
        dst=torch.cat(dst).to(device),
        targets=torch.cat(tgt).to(device),
        bins=tuple(tuple(b) for b in bins),
    )


def _check_packed_attention(model: torch.nn.Module) -> None:
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl not in PACKED_ATTENTION:
        raise NotImplementedError(
            f"algo.pack_tokens needs an attention implementation that separates packed sequences "
            f"by position_ids ({sorted(PACKED_ATTENTION)}); this model uses {impl!r}. Unset algo.pack_tokens."
        )
    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError as err:  # older transformers would attend across the packed sequences
        raise ImportError(
            "algo.pack_tokens needs a transformers with packed-sequence masks "
            "(transformers.masking_utils.find_packed_sequence_indices); upgrade transformers"
        ) from err


def _scatter(values: torch.Tensor, dst: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """(M,) values placed at flat indices dst of a zero (B, R) tensor; differentiable in values."""
    flat = values.new_zeros(shape[0] * shape[1])
    return flat.index_copy(0, dst, values).view(shape)


def packed_token_stats(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    response_length: int,
    budget: int,
    position_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = True,
    with_sum_pi_squared: bool = True,
) -> TokenStats:
    """`causal_lm_token_stats` of a padded micro-batch, computed on its packed layout. (B, R).

    The same statistics for every real response token (up to float rounding: other shapes run
    other kernel blockings); 0 at padded response positions, which the padded path fills with
    values that nothing reads.
    """
    head = plain_linear_head(model)
    _check_packed_attention(model)
    seq_len = input_ids.shape[1]
    if not 1 <= response_length <= seq_len - 1:
        raise ValueError(f"response_length must be in [1, {seq_len - 1}]; got {response_length}")
    packed = pack_rows(input_ids, attention_mask, response_length, budget, position_ids)
    backbone = model.get_decoder()
    hidden = torch.cat(
        [
            backbone(
                input_ids=ids[None], attention_mask=None, position_ids=pos[None], use_cache=False
            ).last_hidden_state[0]  # (T_k, H)
            for ids, pos in zip(packed.input_ids, packed.position_ids)
        ]
    ).index_select(0, packed.src)  # (M, H)
    stats = token_stats_from_hidden(
        hidden,
        head.weight,
        packed.targets,
        bias=head.bias,
        temperature=temperature,
        chunk_size=chunk_size,
        with_entropy=with_entropy,
        with_sum_pi_squared=with_sum_pi_squared,
    )
    shape = (input_ids.shape[0], int(response_length))
    return TokenStats(
        log_probs=_scatter(stats.log_probs, packed.dst, shape),
        entropy=_scatter(stats.entropy, packed.dst, shape) if stats.entropy is not None else None,
        sum_pi_squared=_scatter(stats.sum_pi_squared, packed.dst, shape)
        if stats.sum_pi_squared is not None
        else None,
    )
