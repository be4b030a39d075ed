"""The fields of a config dict that describe its layers, one by one: its layer count, per-layer lists, lists of layer
indices and dicts keyed by layer index, as :mod:`~lightning_automodel.hf.shrink` cuts them to a few layers and the
planner's extrapolation checks that every layer is alike."""

from __future__ import annotations

from typing import Any

LAYER_COUNTS = (
    "num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_blocks", "decoder_layers", "encoder_layers",
    "num_decoder_layers", "num_encoder_layers",
)  # fmt: skip


def layers_alike(values: dict[str, Any]) -> bool:
    """Whether a config dict describes every layer alike: each per-layer list holds one value, each list of layer
    indices is empty or names every layer, each dict keyed by layer index gives every layer the same entry."""
    fields = layer_fields(values)
    if fields is None:
        return True
    count, index_lists, per_layer, by_layer = fields
    return (
        all(len({repr(entry) for entry in value}) <= 1 for value in per_layer.values())
        and all(len(value) in (0, count) for value in index_lists.values())
        and all(
            len(value) == count and len({repr(entry) for entry in value.values()}) == 1
            for name, value in by_layer.items()
            if name not in ("id2label", "label2id")  # keyed by class, not by layer
        )
    )


def layer_fields(values: dict[str, Any]) -> tuple[int, dict, dict, dict] | None:
    """The layer count of a config dict and its fields by layer: lists of layer indices, per-layer lists, dicts keyed
    by layer index; None without a layer count."""
    count_name = next((name for name in LAYER_COUNTS if isinstance(values.get(name), int)), None)
    if count_name is None:
        return None
    count = values[count_name]
    index_lists = {name: value for name, value in values.items() if _is_layer_index_list(name, value, count)}
    per_layer = {
        name: value
        for name, value in values.items()
        if isinstance(value, list) and len(value) == count and name not in index_lists
    }
    by_layer = {name: value for name, value in values.items() if _is_keyed_by_layer(value, count)}
    return count, index_lists, per_layer, by_layer


def _is_layer_index_list(name: str, value: Any, count: int) -> bool:
    return (
        name.endswith(("_idxs", "_ids", "_indices", "_layers"))
        and isinstance(value, list)
        and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < count for v in value)
        and value == sorted(set(value))
    )


def _is_keyed_by_layer(value: Any, count: int) -> bool:
    return isinstance(value, dict) and bool(value) and all(str(k).isdigit() and int(k) < count for k in value)
