"""The Hugging Face models a LightningModule holds, found by type whatever their attribute names: transformers'
models, and diffusers' transformer denoisers (see :mod:`.denoisers`)."""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel

from lightning_automodel.hf.denoisers import is_denoiser


def find_hf_models(module: nn.Module) -> list[nn.Module]:
    """The outermost ``transformers.PreTrainedModel`` and diffusers transformer instances inside ``module``, whatever
    their attribute names."""
    found: list[nn.Module] = []
    for child in module.children():
        if isinstance(child, PreTrainedModel) or is_denoiser(child):
            found.append(child)
        else:
            found.extend(find_hf_models(child))
    return found
