"""The collectives a call dispatches, counted at dispatch: the bytes of each kind, what the benchmarks report and the
tests hold to the whole logits' (a chunked loss must not add a collective); how many, which a refusal must precede."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

NOT_COLLECTIVES = ("wait_tensor", "barrier", "monitored_barrier", "_wrap_tensor_autograd")


class CollectiveBytes(TorchDispatchMode):
    """The bytes of every collective dispatched, by kind: the whole tensor it gathers, reduces or scatters."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace, name = func.namespace, func.__name__.split(".")[0]
        if namespace in ("c10d", "_c10d_functional") and name not in NOT_COLLECTIVES:
            self.bytes[_kind(name)] += _whole_bytes(name, args)
        return func(*args, **kwargs)


class CollectiveCount(TorchDispatchMode):
    """Counts the collectives dispatched while active: a refusal should come before any, so that no rank can be
    left waiting in one. Collectives on meta tensors (the probe's, see lightning_automodel.parallel.probe) only
    propagate shapes, communicate nothing, and do not count."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            self.count += not all(t.device.type == "meta" for t in tensors)
        return func(*args, **(kwargs or {}))


def _kind(name: str) -> str:
    for kind in ("all_gather", "allgather", "reduce_scatter", "all_reduce", "allreduce", "broadcast", "all_to_all"):
        if name.startswith(kind) or name.startswith(f"_{kind}"):
            return kind.replace("allgather", "all_gather").replace("allreduce", "all_reduce")
    return name


def _whole_bytes(name: str, args: tuple) -> int:
    tensors = [t for t in torch.utils._pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
    sizes = [t.numel() * t.element_size() for t in tensors]
    if name == "all_gather_into_tensor":  # the functional one: (input, group_size, group_name)
        return sizes[0] * args[1]
    if name in ("allgather_", "reduce_scatter_"):  # lists: the gathered outputs, the inputs reduced
        return sum(sizes) - (sizes[-1] if name == "allgather_" else sizes[0])
    return max(sizes)
