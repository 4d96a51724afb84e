"""LoRA on the policy: the trainer updates low-rank adapters, the sampler gets merged weights.

Why merged weights for the sampler: vLLM (and a Ray worker's HF engine) hold the plain
architecture, so what they receive after each update is W + (alpha / r) B A under the base model's
own parameter names; they never need to know that LoRA exists. The trainer's model keeps the
adapters separate, so only A and B (and their optimiser state) are trained and checkpointed: a
checkpoint is the adapter, and resuming loads the base weights from `model.path` again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from agent_rl.config import LoraConfig

ADAPTER = "default"
"""peft's name for the one adapter a policy has."""


def apply_lora(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """The model with trainable adapters on `cfg.targets` and every base weight frozen."""
    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model
    except ImportError as err:
        raise ImportError("model.lora.rank > 0 needs peft: pip install 'agent-rl[lora]'") from err
    spec = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=0.0,  # dropout would make the trainer's log-probs differ from the sampler's
        target_modules=list(cfg.targets),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, spec)


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


@torch.no_grad()
def sampler_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a sampler loads: the state dict for a plain model; for a LoRA model, the base model's
    names with every adapted weight merged (W + scale * B A), computed without touching `model`."""
    if not is_lora(model):
        return model.state_dict()
    base = model.get_base_model()
    merged: dict[str, torch.Tensor] = {}
    for name, module in base.named_modules():
        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):
            weight = module.base_layer.weight
            merged[f"{name}.weight"] = weight + module.get_delta_weight(ADAPTER).to(weight.dtype)
            if module.base_layer.bias is not None:
                merged[f"{name}.bias"] = module.base_layer.bias
    for name, tensor in base.state_dict().items():
        if "lora_" in name:
            continue
        plain = name.replace(".base_layer.", ".")
        merged.setdefault(plain, tensor)
    return merged


def policy_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps of the policy: every weight, or only the adapter's under LoRA."""
    if not is_lora(model):
        return model.state_dict()
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, adapter_name=ADAPTER)


def load_policy_state(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """The inverse of `policy_state`; a LoRA checkpoint must carry every adapter weight."""
    if not is_lora(model):
        model.load_state_dict(state)
        return
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, state, adapter_name=ADAPTER)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise KeyError(
            f"LoRA checkpoint does not match the adapter: missing {missing[:3]}, "
            f"unexpected {list(result.unexpected_keys)[:3]}"
        )
