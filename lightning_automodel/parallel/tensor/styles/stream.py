"""Styles for the sequence-parallel residual stream: where it is split along the sequence, gathered back, and the
regions inside a block that need the whole sequence."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel
from torch.utils._pytree import tree_map

from lightning_automodel.parallel.tensor.styles.parameters import whole_local_args


class SequenceParallelAllGather(SequenceParallel):
    """Run a norm on the sequence-sharded residual stream, then all-gather its output once.

    With sequence parallel the residual stream is a ``Shard(1)`` DTensor. The projections after a norm need the
    full sequence; gathering here costs one all-gather per block instead of one per projection (q, k and v would
    each gather the same input). The output stays a replicated DTensor so the projections take it as is.
    """

    def __init__(self, *, sequence_dim: int = 1) -> None:
        super().__init__(sequence_dim=sequence_dim, use_local_output=False)

    @staticmethod
    def _prepare_output_fn(use_local_output: bool, mod: nn.Module, outputs: DTensor, device_mesh: DeviceMesh):
        if isinstance(outputs, DTensor) and any(p.is_shard() for p in outputs.placements):
            outputs = outputs.redistribute(device_mesh, [Replicate()])
        return SequenceParallel._prepare_output_fn(use_local_output, mod, outputs, device_mesh)


class SequenceShardedStream(ParallelStyle):
    """Where the sequence-parallel residual stream begins and ends: the first and the last of the decoder blocks a
    model calls one after another.

    Outside its blocks a model's own code computes on whole tensors (positions, scalings and masks it applies to the
    embedding, states of its own it adds to the stream), so the stream is split inside them only. The first block
    takes its stream argument (``begins_at``: a position or a keyword) as this rank's slice of the sequence, a
    ``Shard(1)`` DTensor: no communication, and in backward the slices' gradients are all-gathered. With ``ends``,
    the block's stream output (what it returns, or the first item) is all-gathered back into a whole tensor.
    """

    def __init__(self, *, begins_at: int | str | None = None, ends: bool = False) -> None:
        super().__init__()
        self.begins_at = begins_at
        self.ends = ends

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.begins_at is not None:
            module.register_forward_pre_hook(partial(self._split_stream, device_mesh), with_kwargs=True)
        if self.ends:
            module.register_forward_hook(partial(_gather_stream, device_mesh))
        return module

    def _split_stream(self, device_mesh: DeviceMesh, module: nn.Module, args: tuple, kwargs: dict):
        key = self.begins_at
        if isinstance(key, int):
            return (*args[:key], _sequence_shard(args[key], mesh=device_mesh), *args[key + 1 :]), kwargs
        return args, {**kwargs, key: _sequence_shard(kwargs[key], mesh=device_mesh)}


def _sequence_shard(stream: torch.Tensor, *, mesh: DeviceMesh) -> DTensor:
    if not isinstance(stream, DTensor):
        stream = DTensor.from_local(stream, mesh, [Replicate()], run_check=False)
    return stream.redistribute(mesh, [Shard(1)])


def _gather_stream(device_mesh: DeviceMesh, module: nn.Module, args: tuple, output: object) -> object:
    def whole(stream: object) -> object:
        return stream.redistribute(device_mesh, [Replicate()]).to_local() if isinstance(stream, DTensor) else stream

    return (whole(output[0]), *output[1:]) if isinstance(output, tuple) else whole(output)


class WholeSequenceRegion(ParallelStyle):
    """A module inside a block that computes on the whole sequence while the blocks' residual stream is split along
    it (sequence parallel): a mixture-of-experts block, whose router and token dispatch must see every token as in
    one process; a token mixer whose projections gather their outputs (Qwen3.5's linear attention).

    Its input, gathered by the norm before it, enters as this rank's whole local copy; its outputs shaped like that
    input (not router logits), or its tokens flattened (Llama 4's experts block returns (tokens, hidden)), leave as
    this rank's slice of the sequence (``Shard(1)``, in the input's shape), whose gradient is gathered on the way
    back. Row-parallel projections inside it all-reduce as without sequence parallel, where one
    reduce-scatter of their total would do: the price of keeping the model's own code.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(whole_local_args, with_kwargs=True)
        module.register_forward_hook(partial(_sequence_sharded_output, device_mesh), with_kwargs=True)
        return module


def _sequence_sharded_output(device_mesh: DeviceMesh, module: nn.Module, args: tuple, kwargs: dict, output: object):
    stream = next(v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor))

    def sharded(value: object) -> object:
        if not isinstance(value, torch.Tensor) or value.shape not in (stream.shape, stream.flatten(0, -2).shape):
            return value
        return _sequence_shard(value.view(stream.shape), mesh=device_mesh)

    return tree_map(sharded, output)
