"""The activations autograd saves for backward, in bytes: what a training step holds at its peak beside the weights
and the optimizer state (CPU has no allocator statistics to read it from)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor


@contextmanager
def saved_activations() -> Iterator[dict[int, int]]:
    """Inside: every tensor autograd saves is noted, {storage address: bytes}, a storage saved twice counted once (a
    DTensor's by its local shard's, a collective's result still in flight by its buffer's). Sum the values after."""
    storages: dict[int, int] = {}
    with torch.autograd.graph.saved_tensors_hooks(partial(_note_storage, storages), _unchanged):
        yield storages


def _note_storage(storages: dict[int, int], tensor: torch.Tensor) -> torch.Tensor:
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    local = local.elem if isinstance(local, AsyncCollectiveTensor) else local
    storage = local.untyped_storage()
    storages[storage.data_ptr()] = storage.nbytes()
    return tensor


def _unchanged(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
