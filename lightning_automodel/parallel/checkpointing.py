"""Activation checkpointing of whole decoder layers.

Uses torch's composable ``checkpoint``, which works through module hooks: parameter names stay those of the
Hugging Face model, so state dicts, checkpoints and exports need no renaming.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed._composable import checkpoint


def apply_activation_checkpointing(model: nn.Module, layers: Sequence[nn.Module]) -> None:
    """Recompute each decoder layer's activations in backward instead of storing them."""
    if not layers:
        raise ValueError(
            f"activation_checkpointing=True found no decoder layers in {type(model).__name__}: it needs a"
            " ModuleList of transformer blocks (model.layers in Hugging Face models)."
        )
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False  # a KV cache built in the first forward would be built again on recompute
    for layer in layers:
        checkpoint(layer)
