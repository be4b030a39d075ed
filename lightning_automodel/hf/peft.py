"""PEFT as this package meets it: the Hugging Face model inside a PEFT model, recognising a LoRA layer, and wrapping
a causal LM in one."""

from __future__ import annotations

from typing import Any

from torch import nn


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The Hugging Face model a PEFT model wraps (whose module names the plans know), or ``model`` itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def is_lora_layer(module: nn.Module) -> bool:
    """A PEFT LoRA layer: a ``base_layer`` with ``lora_A`` / ``lora_B`` adapters beside it."""
    return all(hasattr(module, name) for name in ("base_layer", "lora_A", "lora_B"))


def with_lora(model: nn.Module, lora: dict[str, Any]) -> nn.Module:
    """``model`` wrapped by PEFT with a causal-LM LoRA of these ``LoraConfig`` arguments."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as error:
        raise ImportError('LoRA needs peft: pip install "lightning-automodel[peft]"') from error
    return get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora))
