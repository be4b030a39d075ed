"""The Hugging Face models a LightningModule holds, found by type whatever their attribute names."""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel


def find_hf_models(module: nn.Module) -> list[nn.Module]:
    """The outermost ``transformers.PreTrainedModel`` instances inside ``module``, whatever their attribute names."""
    found: list[nn.Module] = []
    for child in module.children():
        if isinstance(child, PreTrainedModel):
            found.append(child)
        else:
            found.extend(find_hf_models(child))
    return found
