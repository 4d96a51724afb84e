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

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from agent_rl.rollout.engine import Completion, SamplingParams, find_stop_string, per_prompt_params


def top_p_filter(scaled_logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's nucleus to -inf (the most likely token always stays).

    scaled_logits: (B, V) float32, already divided by temperature. top_p: (B,) in (0, 1].
    """
    sorted_logits, order = scaled_logits.sort(dim=-1, descending=True)  # (B, V)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # (B, V) mass of strictly more likely tokens
    drop_sorted = mass_before >= top_p[:, None]
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return scaled_logits.masked_fill(drop, float("-inf"))


class HFEngine:
    """Samples with a transformers causal LM; see agent_rl.rollout.engine for the contract."""

    def __init__(
        self, model: Any, tokenizer: Any, *, max_model_len: int | None = None, seed: int = 0
    ) -> None:
        """`model` may be the trainer's own module: then weights are shared and need no update."""
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
        missing = [n for n, t in own.items() if n not in state_dict and t.data_ptr() not in updated_ptrs]
        if missing:
            raise KeyError(
                f"update_weights: state dict lacks {missing[:5]} (of {len(missing)}); pass the full state dict"
            )

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
        """Draw one token per active row and return its log-prob under the sampling distribution.

        logits: (B, V) float32. temperature, top_p: (B,).
        """
        greedy = temperature <= 0  # (B,)
        safe_t = torch.where(greedy, torch.ones_like(temperature), temperature)
        scaled = logits / safe_t[:, None]  # (B, V)
        # Greedy rows keep the whole vocabulary (top_p 1), matching vLLM's greedy log-probs.
        filtered = top_p_filter(scaled, torch.where(greedy, torch.ones_like(top_p), top_p))
        log_probs = filtered.log_softmax(dim=-1)  # (B, V)
        probs = log_probs.exp()
        tokens: list[int] = []
        lps: list[float] = []
        for i in range(logits.shape[0]):
            if not active[i]:
                tokens.append(self.pad_token_id)
                lps.append(0.0)
                continue
            if bool(greedy[i]):
                tok = int(logits[i].argmax())
            else:
                tok = int(torch.multinomial(probs[i], 1, generator=gens[i]))
            tokens.append(tok)
            lps.append(float(log_probs[i, tok]))
        return tokens, lps

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

    def _left_padded(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask), both (B, W): left padding puts every row's next token at -1."""
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            input_ids[i, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
            attention[i, width - len(prompt) :] = 1
        return input_ids.to(self.device), attention.to(self.device)

    def _forward(self, ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor, cache: Any):
        """Last-position logits (B, V) in float32; the KV cache grows in place."""
        out = self.model(
            input_ids=ids, attention_mask=attention, position_ids=positions, past_key_values=cache, use_cache=True
        )
        return out.logits[:, -1, :].float()

    @torch.no_grad()
    def _generate(self, prompts: Sequence[Sequence[int]], plist: list[SamplingParams]) -> list[Completion]:
        from transformers import DynamicCache

        batch = len(prompts)
        input_ids, attention = self._left_padded(prompts)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)  # (B, W)
        temperature = torch.tensor([p.temperature for p in plist], dtype=torch.float32, device=self.device)
        top_p = torch.tensor([p.top_p for p in plist], dtype=torch.float32, device=self.device)
        gens = self._row_generators(plist)
        cache = DynamicCache()
        logits = self._forward(input_ids, attention, positions, cache)  # (B, V)
        next_pos = positions[:, -1] + 1  # (B,)

        ids: list[list[int]] = [[] for _ in range(batch)]
        lps: list[list[float]] = [[] for _ in range(batch)]
        finish: list[str | None] = [None] * batch
        stop_reason: list[int | str | None] = [None] * batch
        active = [True] * batch
        for _ in range(max(p.max_new_tokens for p in plist)):
            tokens, token_lps = self._sample(logits, temperature, top_p, gens, active)
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
            attention = torch.cat([attention, attention.new_ones((batch, 1))], dim=1)
            logits = self._forward(step_ids, attention, next_pos[:, None], cache)
            next_pos = next_pos + 1
        return [
            Completion(ids[i], lps[i], finish_reason=finish[i] or "length", stop_reason=stop_reason[i])
            for i in range(batch)
        ]
