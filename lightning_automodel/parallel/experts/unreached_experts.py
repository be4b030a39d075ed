"""Experts no token reached still take part in FSDP2's gradient reduction (see
:func:`give_every_expert_a_gradient`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_automodel.parallel.tensor.styles.experts import is_experts


def give_every_expert_a_gradient(model: nn.Module) -> None:
    """Make every experts module's parameters take part in every forward, with weight zero where no token reached them.

    FSDP2 reduces a unit's gradients as one buffer on every rank: a rank whose tokens reached none of a layer's
    experts (Longcat-Flash's zero-computation experts can take them all) would have no gradient for them, and the
    ranks' collectives would no longer match. One element of each parameter, times zero, added to the output gives
    them a zero gradient instead; the output does not change.
    """
    for module in model.modules():
        if is_experts(module):
            module.register_forward_hook(_touch_every_parameter)


def _touch_every_parameter(module: nn.Module, args: tuple, output: Any) -> Any:
    if not isinstance(output, torch.Tensor):
        return output
    params = [p.to_local() if isinstance(p, DTensor) else p for p in module.parameters(recurse=False)]
    touched = sum(p.reshape(-1)[0].to(output.dtype) for p in params if p.requires_grad)
    return output + touched * 0 if isinstance(touched, torch.Tensor) else output
