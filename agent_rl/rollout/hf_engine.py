"""A transformers sampler: batched, left-padded, with a KV cache; CPU or GPU, float32 or bfloat16.

Why our own decoding loop instead of `model.generate`: we need per-sequence seeds (a sample must
not depend on which other sequences share the batch), per-sequence temperature/top-p/stop
settings, and log-probs computed from the very tensor the token was drawn from. `generate`
offers none of these together.

What is covered: greedy and temperature/top-p sampling, eos / stop ids / stop strings, weight
updates by copy or by sharing the trainer's module. What is not covered: top-k, penalties,
speculative decoding, beam search (none is used by on-policy RL here).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from agent_rl.rollout import cpu_heap
from agent_rl.rollout.engine import Completion, SamplingParams, find_stop_string, per_prompt_params
from agent_rl.rollout.prefix_kv import KVEntry, PrefixKVStore, weights_version

DEFAULT_KV_CACHE_BYTES = 2 * 2**30
"""Reused-KV budget: about 90k tokens of a 0.5B Qwen2 in float32 (24 KiB per token)."""


def _nucleus_by_sort(probs: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(threshold, mass) per row by sorting the vocabulary: cheap on an accelerator, ~log V passes on CPU."""
    values = probs.sort(dim=-1, descending=True).values.double()  # (R, V)
    before = values.cumsum(dim=-1) - values  # mass of the more likely tokens (the first of a tie: exact)
    kept = (before < top_p[:, None].double()).sum(dim=-1)  # (R,) >= 1: the top token stays
    threshold = values.gather(-1, (kept - 1)[:, None])  # (R, 1)
    return threshold[:, 0].to(probs.dtype), (values * (values >= threshold)).sum(dim=-1)


def _nucleus_by_radix(probs: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(threshold, mass) per row without sorting the vocabulary: a two-pass radix select on CPU.

    A non-negative float32's bit pattern orders like its value, so its top 16 bits (exponent and 7
    mantissa bits) put every token in one of 16,257 bins (1.0 is the largest). One histogram of mass
    per bin finds the bin where the cumulative mass from the top crosses top_p; only that bin's
    tokens (a relative width of 1/128: few, unless the row is flat) are then sorted to find the
    boundary token. The set a sort finds, at about the cost of three passes over the row.
    """
    rows, bins = probs.shape[0], 0x3F80 + 1
    high = probs.view(torch.int32) >> 16  # (R, V)
    hist = torch.zeros(rows, bins, dtype=probs.dtype, device=probs.device)
    for r in range(rows):  # row by row: int32 indices as they are (an int64 copy costs more than the sum)
        hist[r].index_add_(0, high[r], probs[r])  # float32 sums within one bin only
    hist = hist.double()
    reach = hist.flip(-1).cumsum(-1).flip(-1)  # mass of bins >= b, non-increasing in b
    crossing = (reach >= top_p[:, None].double()).sum(-1) - 1  # (R,): -1 if rounding left < top_p
    edge = crossing.clamp(min=0)[:, None]
    above = (reach.gather(1, edge) - hist.gather(1, edge))[:, 0]  # mass of the bins above the edge
    row, col = (high == crossing.to(torch.int32)[:, None]).nonzero(as_tuple=True)  # the edge bins' tokens
    values = probs[row, col]
    order = values.argsort(descending=True, stable=True)
    order = order[row[order].argsort(stable=True)]  # by row, most likely first
    row, values = row[order], values[order]
    wide = values.double()
    before = wide.cumsum(0) - wide
    first = torch.ones_like(row, dtype=torch.bool)
    first[1:] = row[1:] != row[:-1]
    start = torch.zeros(rows, dtype=torch.float64, device=probs.device)
    start[row[first]] = before[first]  # the running sum where each row's tokens begin
    kept = above[row] + (before - start[row]) < top_p[row].double()
    inf = torch.full((rows,), float("inf"), dtype=probs.dtype, device=probs.device)
    threshold = inf.scatter_reduce(0, row[kept], values[kept], "amin")
    tied = values >= threshold[row]  # the boundary token and its ties
    mass = above.index_add(0, row[tied], wide[tied])
    everything = crossing < 0
    return threshold.masked_fill(everything, 0.0), torch.where(everything, hist.sum(-1), mass)


def nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(threshold, mass) per row: the nucleus is every token with probs >= threshold (ties at the
    boundary stay together), mass its total probability (float64). probs: (B, V) float32, top_p: (B,).

    The nucleus is every token whose strictly-more-likely mass is below top_p. Rows with top_p = 1
    keep everything (threshold 0) without any selection. On CPU the others never sort the vocabulary
    (a radix select, benchmarks/sampler_bench.py); on an accelerator a sort is cheap and a float
    scatter-add is not deterministic, so rows there are sorted.
    """
    threshold = torch.zeros_like(top_p, dtype=probs.dtype)
    mass = probs.sum(-1).double()  # (float32 sums are pairwise: ~1e-7; a float64 pass costs 10x)
    rows = (top_p < 1).nonzero()[:, 0]
    if rows.numel():
        chosen = probs if rows.numel() == probs.shape[0] else probs[rows]
        search = _nucleus_by_radix if probs.device.type == "cpu" else _nucleus_by_sort
        threshold[rows], mass[rows] = search(chosen, top_p[rows])
    return threshold, mass


MAX_REJECTIONS = 64
"""Draws outside the nucleus before `draw` masks the row instead (only when top_p is tiny)."""


def draw(probs: torch.Tensor, generator: torch.Generator, threshold: float = 0.0) -> int:
    """One index j with probs[j] >= threshold, with probability proportional to probs[j] (inverse CDF).

    Why not torch.multinomial: on CPU it costs ~5 ms per row at a 152k vocabulary, ~15x a cumulative
    sum and a binary search. Why draw from the whole row and reject tokens outside the nucleus: a
    draw from p conditioned on the nucleus is exactly a draw from the renormalised nucleus, and the
    row needs no masked copy (a nucleus holds >= top_p of the mass, so ~1 draw per token). The sum
    is in float64 so the CDF does not drift over 152k terms; zero-probability tokens are never drawn.
    """
    cdf = probs.double().cumsum(dim=0)  # (V,)
    for _ in range(MAX_REJECTIONS):
        index = _inverse_cdf(cdf, generator)
        if probs[index] >= threshold:
            return index
    return _inverse_cdf((probs * (probs >= threshold)).double().cumsum(dim=0), generator)


def _inverse_cdf(cdf: torch.Tensor, generator: torch.Generator) -> int:
    """The first index whose cumulative mass exceeds a uniform draw over the total."""
    u = torch.rand((1,), generator=generator, dtype=torch.float64) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), cdf.shape[0] - 1)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    gens: Sequence[torch.Generator],
    active: Sequence[bool],
    pad_token_id: int,
) -> tuple[list[int], list[float]]:
    """Draw one token per active row and return its log-prob under the sampling distribution.

    logits: (B, V). temperature, top_p: (B,). Inactive rows get pad_token_id and 0.0. The log-prob
    is log p(token) - log(nucleus mass): the renormalised nucleus the token was drawn from.
    """
    greedy = temperature <= 0  # (B,)
    safe_t = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits.float() if bool((safe_t == 1).all()) else logits.float() / safe_t[:, None]
    probs = scaled.softmax(dim=-1)  # (B, V)
    # Greedy rows keep the whole vocabulary (top_p 1), matching vLLM's greedy log-probs.
    threshold, mass = nucleus(probs, torch.where(greedy, torch.ones_like(top_p), top_p))
    tokens: list[int] = []
    lps: list[float] = []
    for i in range(logits.shape[0]):
        if not active[i]:
            tokens.append(pad_token_id)
            lps.append(0.0)
            continue
        tok = int(logits[i].argmax()) if bool(greedy[i]) else draw(probs[i], gens[i], float(threshold[i]))
        tokens.append(tok)
        lps.append(math.log(float(probs[i, tok])) - math.log(float(mass[i])))
    return tokens, lps


def _growing_cache(num_layers: int, capacity: int) -> Any:
    """A transformers DynamicCache whose layers write into buffers sized once per generate() call.

    Why: DynamicLayer appends each decode step's keys with torch.cat, which copies the whole cache
    every token; at a 1k-8k-token context that copy, not the model, dominated a decode step. Here a
    step writes only its new column and attention reads a view of the filled part.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        def __init__(self) -> None:
            super().__init__()
            self.length = 0

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            super().lazy_initialization(key_states, value_states)
            batch, heads, _, _ = key_states.shape
            self.key_buffer = key_states.new_zeros((batch, heads, capacity, key_states.shape[-1]))
            self.value_buffer = value_states.new_zeros((batch, heads, capacity, value_states.shape[-1]))

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            if end > capacity:
                raise AssertionError(f"engine bug: KV cache of {capacity} columns asked for {end}")
            self.key_buffer[:, :, self.length : end] = key_states
            self.value_buffer[:, :, self.length : end] = value_states
            self.length = end
            self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.length

    cache = DynamicCache()
    cache.layers = [GrowingLayer() for _ in range(num_layers)]
    return cache


class HFEngine:
    """Samples with a transformers causal LM; see agent_rl.rollout.engine for the contract."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_model_len: int | None = None,
        seed: int = 0,
        kv_reuse: bool = True,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        keep_freed_memory: bool = True,
    ) -> None:
        """`model` may be the trainer's own module: then weights are shared and need no update.

        kv_reuse: keep each finished sequence's KV cache and reuse it when a later prompt extends
            it (the next turn of an episode), so a turn costs its new tokens only. Log-probs equal
            the re-prefill path's to float rounding (tests/agent_rl/rollout/test_kv_reuse.py).
        kv_cache_bytes: most memory the kept caches may hold (least recently used go first).
        keep_freed_memory: on CPU, set this process's malloc thresholds so freed blocks under
            32 MiB are kept for reuse instead of being unmapped and faulted back in on the next
            call (agent_rl.rollout.cpu_heap; 5-9% of a generate call at the rollout bench's sizes).
        """
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError("the tokenizer has no eos_token_id; set tokenizer.eos_token before sampling")
        self.eos_token_id = int(eos)
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else eos)
        self.max_model_len = int(max_model_len or model.config.max_position_embeddings)
        self._seed_source = torch.Generator().manual_seed(seed)
        self.kv_reuse = kv_reuse
        self.kv_store = PrefixKVStore(kv_cache_bytes)
        self._kv_weights = weights_version(model)
        self._last_logits_only = "logits_to_keep" in inspect.signature(model.forward).parameters
        if keep_freed_memory and self.device.type == "cpu":
            cpu_heap.keep_freed_memory()

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: str = "float32", device: str = "cpu", **kwargs: Any
    ) -> HFEngine:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device)
        return cls(model.eval(), tokenizer, **kwargs)

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def update_weights(self, state_dict: Mapping[str, Any]) -> None:
        """Copy the trainer's tensors into the sampler's parameters in place.

        Every parameter must be covered (tied aliases such as lm_head.weight count as covered by
        their twin): a partial update would leave the sampler silently off-policy.
        """
        own = self.model.state_dict()
        unknown = sorted(set(state_dict) - set(own))
        if unknown:
            raise KeyError(
                f"update_weights: keys not in the sampler's model: {unknown[:5]} (of {len(unknown)})"
            )
        updated_ptrs = set()
        for name, value in state_dict.items():
            target = own[name]
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(
                    f"update_weights: {name} has shape {tuple(value.shape)}, expected {tuple(target.shape)}"
                )
            target.copy_(value.detach().to(device=target.device, dtype=target.dtype))
            updated_ptrs.add(target.data_ptr())
        self.clear_kv_cache()
        missing = [n for n, t in own.items() if n not in state_dict and t.data_ptr() not in updated_ptrs]
        if missing:
            raise KeyError(
                f"update_weights: state dict lacks {missing[:5]} (of {len(missing)}); pass the full state dict"
            )

    def clear_kv_cache(self) -> None:
        """Drop every kept KV cache (new weights; the end of a collect(), whose episodes are over)."""
        self.kv_store.clear()
        self._kv_weights = weights_version(self.model)

    release_cache = clear_kv_cache
    """The optional engine hook the collector calls when its episodes are over."""

    # ------------------------------------------------------------------ sampling
    def _row_generators(self, plist: Sequence[SamplingParams]) -> list[torch.Generator]:
        gens = []
        for p in plist:
            seed = (
                p.seed
                if p.seed is not None
                else int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
            )
            gens.append(torch.Generator(device=self.device).manual_seed(seed))
        return gens

    def _sample(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_p: torch.Tensor,
        gens: list[torch.Generator],
        active: list[bool],
    ) -> tuple[list[int], list[float]]:
        """One token per active row and its log-prob (see `sample_tokens`)."""
        return sample_tokens(logits, temperature, top_p, gens, active, self.pad_token_id)

    def _stop_check(self, out_ids: list[int], p: SamplingParams) -> tuple[bool, int | str | None]:
        tok = out_ids[-1]
        if tok == self.eos_token_id or tok in p.stop_token_ids:
            return True, tok
        if p.stop:
            # A stop string ends in the newest token; any earlier occurrence would have stopped us
            # already, so decoding a window a little longer than the longest stop string suffices.
            window = max(len(s) for s in p.stop) + 2
            text = self.tokenizer.decode(out_ids[-window:], skip_special_tokens=False)
            hit = find_stop_string(text, p.stop)
            if hit is not None:
                return True, hit
        return False, None

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Completion]:
        plist = per_prompt_params(prompts, params, self.max_model_len)
        if not prompts:
            return []
        # A shared trainer module may be in train mode (dropout, gradient checkpointing, which
        # disables the KV cache): sample in eval mode and hand the module back as it was.
        was_training = self.model.training
        self.model.eval()
        try:
            return self._generate(prompts, plist)
        finally:
            self.model.train(was_training)

    def _prefill_inputs(
        self,
        prompts: Sequence[Sequence[int]],
        hits: Sequence[tuple[int, KVEntry] | None],
        max_new_tokens: int,
    ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cache, input_ids (B, N), attention (B, C + N), positions (B, N)) for the first forward.

        Row i reuses r_i cached tokens (0 without a hit) and feeds the other n_i = len - r_i. Its
        cached keys sit right-aligned in the C = max r_i past columns, its new ids right-aligned in
        the N = max n_i input columns; the columns between are padding (attention 0), and explicit
        positions continue from r_i. Left padding keeps every row's next token in the last column.
        Without hits this is plain left padding (C = 0).
        """
        batch = len(prompts)
        reuse = [0 if hit is None else hit[0] for hit in hits]
        past = max(reuse)
        width = max(len(p) - r for p, r in zip(prompts, reuse, strict=True))
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((batch, past + width), dtype=torch.long)
        positions = torch.zeros((batch, width), dtype=torch.long)
        for i, (prompt, r) in enumerate(zip(prompts, reuse, strict=True)):
            n = len(prompt) - r
            input_ids[i, width - n :] = torch.tensor(list(prompt[r:]), dtype=torch.long)
            attention[i, past - r : past] = 1
            attention[i, past + width - n :] = 1
            positions[i, width - n :] = torch.arange(r, len(prompt))
        capacity = past + width + max_new_tokens
        cache = _growing_cache(self.model.config.get_text_config().num_hidden_layers, capacity)
        if past:
            some = next(hit[1] for hit in hits if hit is not None)
            for layer in range(len(some.keys)):
                heads, _, dim = some.keys[layer].shape
                kv = [some.keys[layer].new_zeros((batch, heads, past, dim)) for _ in range(2)]  # (B, H, C, D)
                for i, hit in enumerate(hits):
                    if hit is not None:
                        r, entry = hit
                        kv[0][i, :, past - r :] = entry.keys[layer][:, :r]
                        kv[1][i, :, past - r :] = entry.values[layer][:, :r]
                cache.update(kv[0].to(self.device), kv[1].to(self.device), layer)
        return cache, input_ids.to(self.device), attention.to(self.device), positions.to(self.device)

    def _keep_kv(
        self,
        cache: Any,
        attention: torch.Tensor,
        prompts: Sequence[Sequence[int]],
        ids: list[list[int]],
        hits: Sequence[tuple[int, KVEntry] | None],
    ) -> None:
        """Store each row's keys and values (the columns it attended) for its next turn."""
        for i, prompt in enumerate(prompts):
            cols = attention[i].nonzero()[:, 0]  # the row's real tokens, in order
            tokens = [*prompt, *ids[i]][: len(cols)]
            if len(tokens) != len(cols):
                raise AssertionError(f"engine bug: row {i} has {len(cols)} cached columns, {len(tokens)} ids")
            keys = [layer.keys[i].index_select(1, cols) for layer in cache.layers]  # (H, L, D) each
            values = [layer.values[i].index_select(1, cols) for layer in cache.layers]
            hit = hits[i]
            self.kv_store.add(KVEntry(tokens, keys, values), replaces=[] if hit is None else [hit[1]])

    def _forward(self, ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor, cache: Any):
        """Last-position logits (B, V) in float32; the KV cache grows in place.

        Only the last position goes through the LM head where the model allows it: a prefill of
        B x N prompt tokens would otherwise compute and hold B x N x V logits (at a 152k vocabulary,
        0.6 MB per prompt token) to use B x V of them."""
        last = {"logits_to_keep": 1} if self._last_logits_only else {}
        out = self.model(
            input_ids=ids,
            attention_mask=attention,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            **last,
        )
        return out.logits[:, -1, :].float()

    def _lookup(self, prompts: Sequence[Sequence[int]]) -> list[tuple[int, KVEntry] | None]:
        """Each prompt's reusable cached prefix (all None with kv_reuse off)."""
        if not self.kv_reuse:
            return [None] * len(prompts)
        if weights_version(self.model) != self._kv_weights:
            self.clear_kv_cache()  # the weights changed in place (a shared trainer module): stale KV
        return [self.kv_store.lookup(list(p)) for p in prompts]

    @torch.no_grad()
    def _generate(self, prompts: Sequence[Sequence[int]], plist: list[SamplingParams]) -> list[Completion]:
        batch = len(prompts)
        hits = self._lookup(prompts)
        steps = max(p.max_new_tokens for p in plist)
        cache, input_ids, attention, positions = self._prefill_inputs(prompts, hits, steps)
        temperature = torch.tensor([p.temperature for p in plist], dtype=torch.float32, device=self.device)
        top_p = torch.tensor([p.top_p for p in plist], dtype=torch.float32, device=self.device)
        gens = self._row_generators(plist)
        logits = self._forward(input_ids, attention, positions, cache)  # (B, V)
        next_pos = positions[:, -1] + 1  # (B,)

        ids: list[list[int]] = [[] for _ in range(batch)]
        lps: list[list[float]] = [[] for _ in range(batch)]
        finish: list[str | None] = [None] * batch
        stop_reason: list[int | str | None] = [None] * batch
        active = [True] * batch
        for _ in range(steps):
            tokens, token_lps = self._sample(logits, temperature, top_p, gens, active)
            # Rows that sampled a real token this step attend to it; finished rows get padding.
            fed = torch.tensor(active, dtype=attention.dtype, device=self.device)[:, None]  # (B, 1)
            for i in range(batch):
                if not active[i]:
                    continue
                ids[i].append(tokens[i])
                lps[i].append(token_lps[i])
                stopped, why = self._stop_check(ids[i], plist[i])
                if stopped:
                    finish[i], stop_reason[i], active[i] = "stop", why, False
                elif len(ids[i]) >= plist[i].max_new_tokens:
                    finish[i], active[i] = "length", False
            if not any(active):
                break
            step_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]  # (B, 1)
            attention = torch.cat([attention, fed], dim=1)
            logits = self._forward(step_ids, attention, next_pos[:, None], cache)
            next_pos = next_pos + 1
        if self.kv_reuse:
            self._keep_kv(cache, attention, prompts, ids, hits)
        return [
            Completion(ids[i], lps[i], finish_reason=finish[i] or "length", stop_reason=stop_reason[i])
            for i in range(batch)
        ]
