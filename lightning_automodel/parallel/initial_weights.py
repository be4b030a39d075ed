"""The weights a model comes to :func:`~lightning_automodel.parallel.parallelize` with: not made yet (built on the meta
device, materialized by the caller afterwards), or real, and then made the same on every rank before they are split.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

log = logging.getLogger(__name__)


def is_meta(model: nn.Module) -> bool:
    """Whether ``model`` was built on the meta device; a model only partly on meta is refused.

    Materializing re-allocates every tensor, so the real weights of a half-meta model would be lost. A model built
    under ``torch.device("meta")`` can still hold a few real tensors: torch makes ``torch.normal(mean, std, size)``
    with float arguments on the CPU whatever the default device (DiffLlama's lambda vectors). When the input
    embedding is on meta and the real tensors are vectors (a weight a user loaded into a module of a meta-built
    model is a matrix, and is refused), they are moved there: the model's own init gives them their values with the
    rest, or their constructor's (see :func:`~lightning_automodel.hf.initialization.materialize_hf_model`).
    """
    on_meta = [t.is_meta for t in _tensors(model)]
    if all(on_meta) or not any(on_meta):
        return any(on_meta)
    stray = [(name, t) for name, t in [*model.named_parameters(), *model.named_buffers()] if not t.is_meta]
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embedding is None or not embedding.weight.is_meta or any(t.ndim > 1 for _, t in stray):
        raise ValueError(
            f"{type(model).__name__} has tensors both on the meta device and real ones"
            f" ({', '.join(name for name, _ in stray[:4])}{', ...' if len(stray) > 4 else ''} are real). Build the"
            " whole model under `with torch.device('meta'):`, or build it with real weights."
        )
    log.warning(
        "%s was built on the meta device except %s (vectors torch made on the CPU): moved to the meta device and"
        " initialised with the rest",
        type(model).__name__,
        [name for name, _ in stray],
    )
    model.to("meta")
    return True


def broadcast_from_rank0(model: nn.Module) -> None:
    """Overwrite every parameter and buffer with global rank 0's values."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for tensor in _tensors(model):
            if isinstance(tensor, DTensor):
                raise ValueError("broadcast_from_rank0 expects a model that is not parallelized yet.")
            dist.broadcast(tensor, src=0)


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]
