"""Per-token log-probs, entropy and the OTB collision term sum_v p^2, without materialising logits.

Why: OTB's proxy w_t = 1 - 2 p(y_t) + sum_v p(v)^2 needs the full distribution at every token,
and the PPO loss needs log-probs and entropy. A naive `model(...).logits` builds a (B, T, V) tensor
(with V ~ 150k this dominates the memory of the whole forward pass), and autograd then keeps it
(and a softmax of the same size) alive until backward. Here the LM head is applied to chunks of
tokens straight from the final hidden states; only one chunk of logits exists at any time, in the
forward pass *and* in the backward pass (a custom autograd function recomputes each chunk's
logits there instead of saving them).

What is covered: heads that are a plain linear layer (Qwen2, Llama, Mistral; tied embeddings fine),
temperature scaling, gradients for log-probs and entropy w.r.t. hidden states, weight and bias.
What is not: logit soft-capping or scaled heads (rejected with a clear error); gradients of
sum_pi_squared (it is a detached statistic for the advantage estimator).

Numerics: logits are upcast to float32 per chunk. With z the tempered logits, z' = z - max z and
e = exp(z') (every e <= 1, s = sum e >= 1):
    log p(y)    = z'_y - log s
    entropy     = log s - sum_v e z' / s
    sum_v p^2   = exp(logsumexp(2 z) - 2 logsumexp(z)) = sum_v e^2 / s^2
so one exp pass over the vocabulary serves all three, as it does a plain logsumexp, and nothing
can overflow. The elementwise passes run over blocks of a few rows (ROW_BLOCK_BYTES), so the only
chunk-sized buffer is the chunk's logits: at a 152k vocabulary the statistics then cost a few
percent over plain log-probs (benchmarks/proxy_bench.py), and each row's arithmetic is the same
whatever the block size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "TokenStats",
    "causal_lm_token_stats",
    "plain_linear_head",
    "token_stats_from_hidden",
]

DEFAULT_CHUNK_SIZE = 1024
"""Tokens per chunk. Peak extra memory ~ a few chunk_size x V float32 buffers (1024 x 152k ~ 0.6 GB each)."""


@dataclass(frozen=True)
class TokenStats:
    """Per-token statistics of the (tempered) policy; shapes follow the targets, e.g. (B, L)."""

    log_probs: torch.Tensor
    """log p(target); differentiable."""
    entropy: torch.Tensor | None
    """-sum_v p log p; differentiable. None when not requested."""
    sum_pi_squared: torch.Tensor | None
    """sum_v p(v)^2, detached. None when not requested."""


def _stat_dtype(t: torch.Tensor) -> torch.dtype:
    """float32 for bf16/fp16/fp32 models, float64 stays float64 (gradcheck in tests)."""
    return torch.promote_types(t.dtype, torch.float32)


def _chunk_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    logits = torch.nn.functional.linear(hidden, weight, bias)  # (C, V) model dtype, exactly as nn.Linear
    logits = logits.to(_stat_dtype(hidden))  # (C, V) a fresh buffer either way
    if temperature != 1.0:
        logits.div_(temperature)  # in place: no second chunk-sized buffer
    return logits


ROW_BLOCK_BYTES = {"cpu": 4 * 2**20, "other": 256 * 2**20}
"""Bytes of one row block of float32 logits in the elementwise passes. On CPU a block stays in
cache between the passes (max, exp, sums), so they cost little beyond the matmul (at V = 152k
one pass over a whole 1024-token chunk streams 0.6 GB through memory); elsewhere blocks only bound
the temporary. Either way the only chunk-sized buffer is the logits chunk itself."""


def _row_block(logits: torch.Tensor) -> int:
    budget = ROW_BLOCK_BYTES["cpu" if logits.device.type == "cpu" else "other"]
    return max(1, budget // max(1, logits.shape[1] * logits.element_size()))


def _stats_by_row_block(
    z: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    log_probs: torch.Tensor,
    entropy: torch.Tensor | None,
    sum_p2: torch.Tensor | None,
) -> None:
    """Fill lse, log_probs (and entropy, sum p^2) of the rows of z, a block of rows at a time.

    One exp pass serves all three statistics: with z' = z - max z and e = exp(z') (so e <= 1),
    s = sum e, logsumexp(z) = max + log s, log p = z' - log s, H = log s - sum e z' / s and
    sum p^2 = sum e^2 / s^2 = exp(logsumexp(2z) - 2 logsumexp(z)), none of which can overflow.
    Entropy and sum p^2 are reductions over the block while it is in cache (no pass writes a
    buffer), so they add little to the plain log-probs. Each row's arithmetic is the same whatever
    the block size. z is overwritten.
    """
    rows = _row_block(z)
    e_buffer = torch.empty_like(z[:rows])  # (b, V) the only other buffer: one row block, reused
    for first in range(0, z.shape[0], rows):
        block = slice(first, first + rows)
        zb = z[block]  # (b, V) a view of the chunk
        z_max = zb.amax(dim=-1, keepdim=True)  # (b, 1)
        shifted = zb.sub_(z_max)  # (b, V) in place: z' <= 0
        e = torch.exp(shifted, out=e_buffer[: zb.shape[0]])  # (b, V)
        total = e.sum(-1)  # (b,)
        log_total = total.log()  # (b,)
        lse[block] = z_max.squeeze(1) + log_total
        log_probs[block] = shifted.gather(1, target[block]).squeeze(1) - log_total
        if sum_p2 is not None:
            sum_p2[block] = torch.linalg.vecdot(e, e) / total.square()
        if entropy is not None:
            entropy[block] = log_total - torch.linalg.vecdot(e, shifted) / total


def _logit_grads_by_row_block(
    z: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    grad_log_probs: torch.Tensor | None,
    entropy: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
) -> torch.Tensor:
    """d loss / d z for the rows of the tempered logits z, written into z, a block of rows at a time.

    With g and h the incoming gradients of log p(y) and H: d log p(y) / dz = onehot(y) - p and
    dH / dz = -p (log p + H), so the sum is p * (-h log p - (h H + g)) + g onehot(y), three
    in-place passes after the exp. Returns z (now the gradient).
    """
    rows = _row_block(z)
    p_buffer = torch.empty_like(z[:rows]) if grad_entropy is not None else None
    for first in range(0, z.shape[0], rows):
        block = slice(first, first + rows)
        log_p = z[block].sub_(lse[block, None])  # (b, V) in place
        g = grad_log_probs[block, None] if grad_log_probs is not None else None  # (b, 1)
        if grad_entropy is not None:
            h = grad_entropy[block, None]  # (b, 1)
            p = torch.exp(log_p, out=p_buffer[: log_p.shape[0]])  # (b, V)
            offset = h * entropy[block, None] + (g if g is not None else 0.0)  # (b, 1)
            grad_z = log_p.mul_(-h).sub_(offset).mul_(p)
        elif g is not None:
            grad_z = log_p.exp_().mul_(-g)  # in place: p itself is not needed
        else:
            grad_z = log_p.zero_()
        if g is not None:
            grad_z.scatter_add_(1, target[block], g)
    return z


def _forward_chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    chunk_size: int,
    with_entropy: bool,
    with_sum_pi_squared: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> log_probs, entropy, sum_pi_squared, logsumexp; each (N,) (unrequested ones empty)."""
    n, dtype = hidden.shape[0], _stat_dtype(hidden)
    log_probs = hidden.new_empty(n, dtype=dtype)
    lse_all = hidden.new_empty(n, dtype=dtype)
    entropy = hidden.new_empty(n if with_entropy else 0, dtype=dtype)
    sum_p2 = hidden.new_empty(n if with_sum_pi_squared else 0, dtype=dtype)
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        z = _chunk_logits(hidden[start:end], weight, bias, temperature)  # (C, V)
        _stats_by_row_block(
            z,
            targets[start:end, None],
            lse_all[start:end],
            log_probs[start:end],
            entropy[start:end] if with_entropy else None,
            sum_p2[start:end] if with_sum_pi_squared else None,
        )
        del z
    return log_probs, entropy, sum_p2, lse_all


class _ChunkedHeadStats(torch.autograd.Function):
    """Autograd for log-probs and entropy that recomputes each chunk's logits in backward."""

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, targets, temperature, chunk_size, with_entropy, with_sum_pi_squared
    ):
        log_probs, entropy, sum_p2, lse = _forward_chunks(
            hidden, weight, bias, targets, temperature, chunk_size, with_entropy, with_sum_pi_squared
        )
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.mark_non_differentiable(sum_p2)
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None, not zeros
        return log_probs, entropy, sum_p2

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy, _grad_sum_p2):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        # None when the loss does not use the entropy (a metric only, or not computed at all):
        # then its backward is skipped.
        use_entropy = grad_entropy is not None
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_hidden = torch.empty_like(hidden) if need_h else None
        acc = _stat_dtype(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        n = hidden.shape[0]
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            h = hidden[start:end]  # (C, H)
            grad_z = _logit_grads_by_row_block(
                _chunk_logits(h, weight, bias, temperature),  # (C, V) the only chunk-sized buffer
                targets[start:end, None],
                lse[start:end],
                grad_log_probs[start:end] if grad_log_probs is not None else None,
                entropy[start:end] if use_entropy else None,
                grad_entropy[start:end] if use_entropy else None,
            )  # (C, V)
            if temperature != 1.0:
                grad_z.div_(temperature)
            grad_logits = grad_z.to(hidden.dtype)  # (C, V)
            if need_h:
                grad_hidden[start:end] = grad_logits @ weight
            if need_w:
                grad_weight.add_((grad_logits.T @ h).to(acc))
            if need_b:
                grad_bias.add_(grad_z.sum(0))
            del grad_z, grad_logits
        if need_w:
            grad_weight = grad_weight.to(weight.dtype)
        if need_b:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def token_stats_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = True,
    with_sum_pi_squared: bool = True,
) -> TokenStats:
    """Log-probs of `targets`, entropy and sum p^2 under softmax((hidden @ weight.T + bias) / temperature).

    hidden:  (..., H) final hidden states (after the model's last norm), the position *before* each target.
    weight:  (V, H) LM head weight; bias: (V,) or None.
    targets: (...) long token ids, same leading shape as hidden.
    Returns TokenStats with tensors of the targets' shape, float32 (float64 for float64 inputs).
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} must share leading dims"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be (V, {hidden.shape[-1]}); got {tuple(weight.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (got {temperature}); greedy decoding has no distribution")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    lead = targets.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # (N, H)
    flat_targets = targets.reshape(-1).long()  # (N,)
    if flat_targets.numel() and (int(flat_targets.min()) < 0 or int(flat_targets.max()) >= weight.shape[0]):
        raise ValueError(f"targets must be token ids in [0, {weight.shape[0]}); pad positions need a real id")
    args = (flat_hidden, weight, bias, flat_targets, float(temperature), int(chunk_size))
    tracked = [t for t in (flat_hidden, weight, bias) if t is not None and t.requires_grad]
    if torch.is_grad_enabled() and tracked:
        log_probs, entropy, sum_p2 = _ChunkedHeadStats.apply(*args, with_entropy, with_sum_pi_squared)
    else:
        log_probs, entropy, sum_p2, _ = _forward_chunks(*args, with_entropy, with_sum_pi_squared)
    return TokenStats(
        log_probs=log_probs.reshape(lead),
        entropy=entropy.reshape(lead) if with_entropy else None,
        sum_pi_squared=sum_p2.reshape(lead) if with_sum_pi_squared else None,
    )


def plain_linear_head(model: torch.nn.Module) -> torch.nn.Linear:
    """The model's LM head, after checking it is a plain linear map (what the chunked head computes)."""
    config = getattr(model, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if getattr(config, attr, None) not in (None, 1.0):
            raise NotImplementedError(
                f"{type(model).__name__} transforms its logits ({attr}); the chunked head only supports a "
                "plain linear LM head. Use the model's own logits for this architecture."
            )
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise NotImplementedError(f"LM head is {type(head).__name__}, expected torch.nn.Linear")
    return head


def causal_lm_token_stats(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    response_length: int | None = None,
    position_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = True,
    with_sum_pi_squared: bool = True,
) -> TokenStats:
    """TokenStats for the last `response_length` tokens of `input_ids` under a HF causal LM. (B, R).

    Runs the backbone (`model.get_decoder()`, i.e. `model.model` for Qwen2) for hidden states, then
    the chunked head on the R positions that predict the response tokens input_ids[:, T-R:].
    response_length=None scores every token after the first (R = T-1).
    position_ids default to cumsum(attention_mask) - 1, so left padding gets generation's positions.
    """
    head = plain_linear_head(model)
    seq_len = input_ids.shape[1]
    r = seq_len - 1 if response_length is None else int(response_length)
    if not 1 <= r <= seq_len - 1:
        raise ValueError(f"response_length must be in [1, {seq_len - 1}] for sequences of {seq_len}; got {r}")
    if position_ids is None and attention_mask is not None:
        # Left-padded rows must count positions from their first real token, as generation did;
        # a plain forward would otherwise use 0..T-1 and score different log-probs.
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    backbone = model.get_decoder()
    out = backbone(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    )
    hidden = out.last_hidden_state[:, seq_len - r - 1 : seq_len - 1]  # (B, R, H)
    targets = input_ids[:, seq_len - r :]  # (B, R)
    return token_stats_from_hidden(
        hidden,
        head.weight,
        targets,
        bias=head.bias,
        temperature=temperature,
        chunk_size=chunk_size,
        with_entropy=with_entropy,
        with_sum_pi_squared=with_sum_pi_squared,
    )
