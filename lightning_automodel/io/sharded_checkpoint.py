"""Lightning's sharded checkpoints (torch's distributed checkpoint: shards, their index ``.metadata``, and
Lightning's ``meta.pt``) read into this run's layout, whatever layout saved them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.load import _METADATA_FILENAME
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from lightning_automodel.hf.initialization import copy_shard
from lightning_automodel.hf.packed_weights import is_packed, packed_block_keys, packed_blocks
from lightning_automodel.io.checkpoint_contents import WEIGHTS, Held, Stored, folded_blocks, optimizer_key


class ShardedCheckpoint:
    """A sharded checkpoint at ``path``, its index read."""

    def __init__(self, path: Path, *, weights_only: bool | None) -> None:
        self.path = path
        self.weights_only = weights_only
        self.index = FileSystemReader(path).read_metadata().state_dict_metadata

    def contents(self, held_by_rank: list[Held]) -> Stored:
        """What the checkpoint holds (its index: the same whatever this run holds, ``held_by_rank``)."""
        sizes = {key: tuple(meta.size) for key, meta in self.index.items() if isinstance(meta, TensorStorageMetadata)}
        counts: dict[int, set[str]] = {}
        for key in self.index:  # optimizer_<i>.param_groups.<group>.<setting>
            head, _, rest = key.partition(".param_groups.")
            if head.startswith("optimizer_") and rest:
                counts.setdefault(int(head[len("optimizer_") :]), set()).add(rest.partition(".")[0])
        optimizers = max(counts, default=-1) + 1
        return Stored(folded_blocks(sizes), [len(counts.get(index, ())) for index in range(optimizers)])

    def load_weights(self, model_state: dict[str, Any], *, strict: bool) -> None:
        _load({WEIGHTS[:-1]: model_state}, self.path, self.index, strict=strict)

    def load_optimizer(self, index: int, optimizer_state: dict[str, Any], *, stored: Stored) -> list[dict[str, Any]]:
        """Fill ``optimizer_state`` (this run's, by parameter name) in place, from the shards, which key it by name
        (``stored``, what :meth:`contents` found, places nothing); returns each param group's saved settings, by
        position."""
        held = [list(group["params"]) for group in optimizer_state["param_groups"]]
        _load({optimizer_key(index): optimizer_state}, self.path, self.index, strict=False)
        for group, params in zip(optimizer_state["param_groups"], held, strict=True):
            group["params"] = params  # as one rank saved them: under pp, another stage's
        return [{k: v for k, v in group.items() if k != "params"} for group in optimizer_state["param_groups"]]

    def metadata(self) -> dict[str, Any]:
        """Lightning's ``meta.pt``: the checkpoint but the weights and optimizer states (loops, callbacks, ...)."""
        return torch.load(self.path / _METADATA_FILENAME, weights_only=self.weights_only)


def _load(state: dict[str, Any], path: Path, stored: dict[str, Any], *, strict: bool) -> None:
    """Load ``state`` in place. A packed weight saved by another layout (as one tensor, or in blocks where this
    layout holds it whole) cannot be read slice by slice: each rank reads it whole, one at a time, and keeps its
    shard. ``strict=False`` leaves entries the checkpoint lacks as they are."""
    mismatched: list[tuple[list[str], torch.Tensor]] = []
    split: list[tuple[DTensor, dict[str, DTensor]]] = []
    request = _request(state, "", stored, packed_block_keys(stored), mismatched, split)
    dcp.load(request, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=not strict))
    for target, blocks in split:  # blocks alias the weight, unless made on another device (CPU offload)
        for chunk, block in zip(target.to_local().chunk(len(blocks)), blocks.values(), strict=True):
            chunk.copy_(block.to_local())
    for keys, target in mismatched:
        if not keys:  # not in the checkpoint: refused beforehand when strict (see checkpoint_contents.misfit)
            continue
        whole = {key: torch.empty(stored[key].size, dtype=stored[key].properties.dtype) for key in keys}
        dcp.load(whole, checkpoint_id=path)
        copy_shard(target, torch.cat(list(whole.values())))


def _request(
    tree: Any, prefix: str, stored: dict[str, Any], blocks_of: dict[str, list[str]], mismatched: list, split: list
) -> Any:
    """What to ask torch's checkpoint reader for, in the shape of ``tree``; tensors stored in another form go to
    ``mismatched`` with the checkpoint keys that hold them, packed weights read as blocks to ``split``."""
    if isinstance(tree, dict):
        requests = {k: _request(v, f"{prefix}{k}.", stored, blocks_of, mismatched, split) for k, v in tree.items()}
        return {key: value for key, value in requests.items() if value is not None}
    if not isinstance(tree, torch.Tensor):
        return tree
    key = prefix[:-1]
    blocks = blocks_of.get(key, [])
    if is_packed(tree) and blocks:
        split.append((tree, packed_blocks(tree)))
        return split[-1][1]
    if not is_packed(tree) and (key in stored or not blocks):
        return tree
    mismatched.append(([key] if key in stored else blocks, tree))
    return None
