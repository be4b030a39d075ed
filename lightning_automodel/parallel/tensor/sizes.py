"""Checks that run before any sharding, so a size that tp cannot split fails with a message instead of a hang."""

from __future__ import annotations

from torch import nn

from lightning_automodel.hf.layer_configs import layer_configs

# Config fields whose sizes tensor parallelism splits, and why each must divide evenly.
_SPLIT_SIZES = (
    ("num_attention_heads", "attention heads are split across tp ranks"),
    # A single key/value head (multi-query attention) is kept whole on every rank (see plans/multi_query.py).
    ("num_key_value_heads", "key/value heads are split across tp ranks"),
    ("intermediate_size", "the MLP hidden size is split across tp ranks"),
    ("vocab_size", "the embedding and lm_head are split on the vocabulary"),
)


def model_config(model: nn.Module) -> object | None:
    """The (text) config of a Hugging Face model, or None for a plain module."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        return config.get_text_config()
    return config


def validate_tp_sizes(model: nn.Module, tp: int) -> None:
    """Raise a ValueError naming every config size that ``tp`` does not divide, and the tp values that work."""
    config = model_config(model)
    if config is None or tp == 1:
        return
    layers = layer_configs(config)  # a heterogeneous config's layers each their own sizes
    values = {name: [getattr(layer, name, None) for layer in layers] for name, _ in _SPLIT_SIZES}
    sizes = {name: sorted({v for v in found if isinstance(v, int)}) for name, found in values.items()}
    sizes["num_key_value_heads"] = [value for value in sizes["num_key_value_heads"] if value != 1]  # multi-query: whole
    failing = [(name, why) for name, why in _SPLIT_SIZES if any(value % tp for value in sizes[name])]
    if not failing:
        return
    every = [value for values in sizes.values() for value in values]
    valid = [t for t in range(1, max(every) + 1) if all(value % t == 0 for value in every)]
    shown = {name: values[0] if len(values) == 1 else values for name, values in sizes.items()}
    details = "; ".join(f"{name}={shown[name]} ({why})" for name, why in failing)
    raise ValueError(
        f"tp={tp} does not divide {details}. tp values that divide every split size of this model: {valid}."
    )
