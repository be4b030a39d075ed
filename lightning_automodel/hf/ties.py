"""Tied parameters (an lm_head sharing the embedding's weight) kept tied through sharding and ``to_empty``."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor


@contextmanager
def ties_kept(model: nn.Module) -> Iterator[None]:
    """Parameters tied when entering are tied again on leaving: sharding, and ``to_empty``, give every module a
    Parameter of its own."""
    ties = _tied_parameter_names(model)
    yield
    _retie(model, ties)


def to_empty_tied(model: nn.Module, *, device: torch.device | str) -> None:
    """``model.to_empty(device=device)``, its tied parameters still tied (FSDP2's units keep their own ties)."""
    with ties_kept(model):
        model.to_empty(device=device)


def _tied_parameter_names(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that share one Parameter (e.g. lm_head.weight and embed_tokens.weight)."""
    by_identity: dict[int, list[str]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        by_identity[id(param)].append(name)
    return [names for names in by_identity.values() if len(names) > 1]


def _retie(model: nn.Module, ties: Sequence[list[str]]) -> None:
    """Point every name of a tied group back at one Parameter (sharding creates one Parameter per module)."""
    for first, *others in ties:
        shared = model.get_parameter(first)
        for name in others:
            param = model.get_parameter(name)
            if isinstance(param, DTensor) != isinstance(shared, DTensor) or (
                isinstance(shared, DTensor) and param.placements != shared.placements
            ):
                raise ValueError(
                    f"{first} and {name} are tied, but the tensor-parallel plan shards them differently"
                    f" ({_layout(shared)} vs {_layout(param)}). Give both modules styles with the same weight"
                    " layout (e.g. RowwiseParallel embedding and ColwiseParallel lm_head both shard the vocab)."
                )
            owner_name, _, leaf = name.rpartition(".")
            model.get_submodule(owner_name).register_parameter(leaf, shared)


def _layout(tensor: torch.Tensor) -> str:
    return str(tensor.placements) if isinstance(tensor, DTensor) else "not sharded"
