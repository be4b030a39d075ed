"""The output shards, planned as ``save_pretrained`` plans them, from names, shapes and dtypes alone (a meta model).

``save_pretrained`` drops tied aliases, reverts transformers' conversions (renames; fused experts split per expert
and projection, the pieces views of one storage or of a copy), then lets huggingface_hub split the result: in order,
a shard closes when the next tensor would pass ``max_shard_size``, and views of one storage count once (its whole
size) and go where the first one went. Here the same steps run on fake tensors, which keep shapes, dtypes and which
storage each view shares, without memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

DEFAULT_MAX_SHARD_SIZE = "50GB"  # save_pretrained's in transformers 5
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class ShardPlan:
    """``files``: each output file's stored names; ``sources``: each stored name's model tensor (state-dict name),
    ``specs``: each stored tensor as a meta tensor (dtype, shape);
    ``index``: the index file's content, None for one file."""

    files: dict[str, list[str]]
    sources: dict[str, str]
    specs: dict[str, torch.Tensor]
    index: dict | None


def plan_shards(model: nn.Module, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> ShardPlan:
    """The files ``model.save_pretrained(directory, max_shard_size=max_shard_size)`` writes for ``model`` (on the
    meta device, each tensor in the dtype to write)."""
    from huggingface_hub import split_state_dict_into_shards_factory
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = model.state_dict()
    for name in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(name, None)
    state = remove_tied_weights_from_state_dict(state, model)
    with FakeTensorMode():
        fakes = {name: torch.empty(tensor.shape, dtype=tensor.dtype) for name, tensor in state.items()}
        stored = revert_weight_conversion(model, fakes)  # save_pretrained's names, in its order, and its views
        storages = {name: (t.untyped_storage()._cdata, t.untyped_storage().nbytes()) for name, t in stored.items()}
        specs = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in stored.items()}
        each = {name: list(as_stored(model, name, tensor)) for name, tensor in fakes.items()}
    sources = {piece: name for name, pieces in each.items() for piece in pieces}
    if set(specs) != set(sources) or len(sources) != sum(map(len, each.values())):
        joined = sorted(set(specs) ^ set(sources))[:4]
        raise ValueError(
            f"{type(model).__name__}'s save_pretrained joins several tensors into one ({joined}), which an export"
            " shard by shard does not do: load the model whole and call save_pretrained."
        )
    split = split_state_dict_into_shards_factory(
        storages,
        get_storage_id=lambda storage: storage[0],
        get_storage_size=lambda storage: storage[1],
        filename_pattern=WEIGHTS_NAME.replace(".safetensors", "{suffix}.safetensors"),
        max_shard_size=max_shard_size,
    )
    index = None
    if split.is_sharded:
        metadata = {"total_parameters": model.num_parameters(), **split.metadata}
        index = {"metadata": metadata, "weight_map": split.tensor_to_filename}
    return ShardPlan(split.filename_to_tensors, sources, specs, index)


def as_stored(model: nn.Module, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """What ``save_pretrained`` writes for the model tensor ``name``: itself, renamed, or converted (split per
    expert, transposed...) by transformers' own reverse conversion of that tensor alone."""
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(model, {name: tensor}))
