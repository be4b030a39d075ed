"""The config each decoder layer reads. transformers' heterogeneous configs (``per_layer_config``) give layers their
own head width or head count, and refuse to read one for the whole model (``AmbiguousGlobalPerLayerAttributeError``):
what depends on them is read layer by layer."""

from __future__ import annotations

from typing import Any


def layer_configs(config: Any) -> list[Any]:
    """The config of each of ``config``'s layers where they differ (a heterogeneous config), else ``config`` alone."""
    if not getattr(config, "is_heterogeneous", False):
        return [config]
    return [config.per_layer_config[index] for index in range(config.num_hidden_layers)]


def attention_shapes(config: Any) -> list[tuple[int, int, int]]:
    """(query heads, key/value heads, head width) of each layer config of ``config`` (one for a homogeneous one)."""
    shapes = []
    for layer in layer_configs(config):
        heads = layer.num_attention_heads
        kv_heads = getattr(layer, "num_key_value_heads", None) or heads
        if getattr(layer, "multi_query", False) and not getattr(layer, "new_decoder_architecture", False):
            kv_heads = 1  # Falcon's multi-query attention, its num_kv_heads aside
        shapes.append((heads, kv_heads, getattr(layer, "head_dim", None) or layer.hidden_size // heads))
    return shapes
