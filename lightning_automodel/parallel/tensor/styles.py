"""Parallel styles that torch does not ship.

Each style is a small subclass of a torch ``ParallelStyle`` that changes only the layout at a module's edge.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from types import MethodType

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.utils._pytree import tree_map


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


class ReplicateOnShardedInput(ParallelStyle):
    """A module whose parameters every rank needs whole while it computes on activations tensor parallel splits: a
    per-head norm over head_dim (Qwen3's q_norm), an activation function's learned scalars (xIELU), a norm over a
    hidden size the plan splits (BitNet's sub-norms).

    Left as it is, each rank would compute its parameters' gradient from its own shard of the activations and keep
    it: a wrong gradient, silently. Here its parameters and buffers (its submodules' too) become replicated DTensors
    and its plain tensor inputs DTensors of the layout they have: ``input_layouts`` gives a placement per argument
    position or keyword (``Shard(d)`` for one split on dim d; an argument it does not name is whole). DTensor then
    computes the module on the global activation: it sums the parameters' partial gradients over tp, and reduces
    across a split dimension where the module reduces (a norm's mean). With ``use_local_output`` the outputs go back
    to this rank's local tensors; a module given DTensors (the sequence-parallel residual stream) keeps DTensors.
    """

    def __init__(self, *, input_layouts: Mapping[int | str, Placement], use_local_output: bool = True) -> None:
        super().__init__()
        self.input_layouts = dict(input_layouts)
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_module(module, device_mesh)  # replicates every parameter and buffer not a DTensor already
        module.register_forward_pre_hook(partial(self._prepare_inputs, device_mesh), with_kwargs=True)
        if self.use_local_output:
            module.register_forward_hook(lambda module, args, output: tree_map(_local_part, output))
        return module

    def _prepare_inputs(self, device_mesh: DeviceMesh, module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        def convert(key: int | str, value: object) -> object:
            if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
                return value
            placement = self.input_layouts.get(key, Replicate())
            return DTensor.from_local(value, device_mesh, [placement], run_check=False)

        args = tuple(convert(index, value) for index, value in enumerate(args))
        return args, {key: convert(key, value) for key, value in kwargs.items()}


def _local_part(value: object) -> object:
    """This rank's part of a DTensor output (a partial sum is summed first); anything else as it is."""
    if not isinstance(value, DTensor):
        return value
    if any(p.is_partial() for p in value.placements):
        value = value.redistribute(placements=[Replicate() if p.is_partial() else p for p in value.placements])
    return value.to_local()


class PackedColwiseParallel(ParallelStyle):
    """Column-parallel for a fused projection of ``parts`` equal blocks: Phi3's [gate; up], [q; k; v] when there are
    as many KV heads as heads (Phi3's qkv_proj, MPT's Wqkv, GPT-2's ``Conv1D`` c_attn).

    Plain column sharding would hand rank 0 all of gate and rank 1 all of up: it runs, and it is wrong. Each
    rank must keep its slice of every block, [gate_r; up_r]. ``_StridedShard(dim, split_factor=parts)`` says
    exactly that (dim 0 of a Linear's weight, dim 1 of a ``Conv1D``'s, stored (in, out)), so the parameter's global
    view stays the Hugging Face layout and checkpoints are unchanged. DTensor has no matmul rule for that placement,
    so the projection runs on local tensors; the input gradient, partial on each rank, is summed over tp on its way
    back.
    """

    def __init__(self, *, parts: int) -> None:
        super().__init__()
        self.parts = parts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear) and not is_conv1d(module):
            raise TypeError(f"PackedColwiseParallel shards nn.Linear and Conv1D modules, not {type(module).__name__}.")
        if output_width(module) % (self.parts * device_mesh.size()):
            raise ValueError(
                f"PackedColwiseParallel: {output_width(module)} output features are not {self.parts} blocks that"
                f" split evenly over {device_mesh.size()} ranks."
            )
        output_dims = {"weight": 1 if is_conv1d(module) else 0, "bias": 0}
        for name, param in list(module.named_parameters(recurse=False)):
            placement = [_StridedShard(output_dims[name], split_factor=self.parts)]
            sharded = distribute_tensor(param, device_mesh, placement, src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.tp_mesh = device_mesh
        module.forward = MethodType(_packed_forward, module)  # one function for all layers: one compiled graph
        return module


def is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2, OpenAI GPT): a linear layer whose weight is stored (in, out)."""
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, Conv1D)


def output_width(module: nn.Module) -> int:
    """The output features of a Linear or ``Conv1D``."""
    return module.nf if is_conv1d(module) else module.out_features


def _packed_forward(self: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    if not isinstance(hidden, DTensor):
        hidden = DTensor.from_local(hidden, self.tp_mesh, [Replicate()], run_check=False)
    hidden = hidden.redistribute(self.tp_mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    bias = self.bias.to_local() if self.bias is not None else None
    weight = self.weight.to_local()
    return F.linear(hidden, weight.t() if is_conv1d(self) else weight, bias)


class RegroupedColwiseParallel(ColwiseParallel):
    """Column-parallel for a fused projection of unequal blocks: Phi3's [q; k; v] with grouped KV heads.

    Each rank needs its slice of every block, [q_r; k_r; v_r], but no DTensor placement describes that split
    when the blocks differ in size. The weight is therefore split the plain way (the Hugging Face layout, so
    checkpoints are unchanged), and the outputs are regrouped: one all-gather of the projection output per
    layer, after which each rank keeps its own slice of every block. Attention then runs on this rank's heads
    only. The gradients each rank sends back cover only its slices, so they are summed on the way back.
    """

    def __init__(self, *, block_sizes: tuple[int, ...]) -> None:
        super().__init__(output_layouts=Shard(-1), use_local_output=False)
        self.block_sizes = block_sizes

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if any(size % device_mesh.size() for size in self.block_sizes):
            raise ValueError(
                f"RegroupedColwiseParallel: blocks {self.block_sizes} do not split over {device_mesh.size()} ranks."
            )
        return super()._apply(module, device_mesh)

    def _prepare_output_fn(self, output_layouts, use_local_output, mod, output: DTensor, device_mesh: DeviceMesh):
        """Keep this rank's slice of every block (an instance method: it needs the block sizes)."""
        full = output.redistribute(device_mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        rank, size = device_mesh.get_local_rank(), device_mesh.size()
        blocks = full.split(list(self.block_sizes), dim=-1)
        return torch.cat([block.chunk(size, dim=-1)[rank] for block in blocks], dim=-1)


class Conv1DColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for transformers' ``Conv1D``: its weight is stored (in, out), so the output features it
    splits are dim 1 of the weight (and dim 0 of the bias). Forward runs on DTensors, as torch's style does."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        return _distribute_conv1d(self, module, device_mesh, {"weight": Shard(1), "bias": Shard(0)})


class Conv1DRowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` for transformers' ``Conv1D``: the input features it splits are dim 0 of the (in, out)
    weight; the bias stays whole and DTensor adds it once to the summed output."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return _distribute_conv1d(self, module, device_mesh, {"weight": Shard(0), "bias": Replicate()})


def _distribute_conv1d(
    style: ColwiseParallel | RowwiseParallel, module: nn.Module, device_mesh: DeviceMesh, layouts: dict[str, Placement]
) -> nn.Module:
    """Shard a ``Conv1D``'s parameters as ``layouts`` says, with ``style``'s input and output layouts."""

    def partition(name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param, device_mesh, [layouts[param_name]], src_data_rank=style.src_data_rank)
            module.register_parameter(param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))

    return distribute_module(
        module,
        device_mesh,
        partition,
        partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
        partial(style._prepare_output_fn, style.output_layouts, style.use_local_output),
    )


class VocabParallelEmbedding(RowwiseParallel):
    """The vocabulary-parallel embedding of the Llama plan (``RowwiseParallel`` with whole token ids), whose output
    is a tensor of its own: torch's is a view made by an autograd Function, which model code may not modify in place,
    and some does (CTRL's ``inputs_embeds *= sqrt(d_model)``, GIT's ``embeddings += position_embeddings``)."""

    def __init__(self) -> None:
        super().__init__(input_layouts=Replicate())

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh).clone()


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
    input (not router logits) leave as this rank's slice of the sequence (``Shard(1)``), whose gradient is gathered on
    the way back. Row-parallel projections inside it all-reduce as without sequence parallel, where one
    reduce-scatter of their total would do: the price of keeping the model's own code.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(_whole_local_inputs, with_kwargs=True)
        module.register_forward_hook(partial(_sequence_sharded_output, device_mesh), with_kwargs=True)
        return module


def _whole_local_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return tree_map(whole_local, (args, kwargs))


def _sequence_sharded_output(device_mesh: DeviceMesh, module: nn.Module, args: tuple, kwargs: dict, output: object):
    stream = next(v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor))

    def sharded(value: object) -> object:
        if not isinstance(value, torch.Tensor) or value.shape != stream.shape:
            return value
        return _sequence_shard(value, mesh=device_mesh)

    return tree_map(sharded, output)


class KeptWhole(ParallelStyle):
    """A projection every rank keeps whole on purpose, so that the coverage check counts its weight as whole by
    design: a low-rank down-projection (multi-head latent attention's ``q_a_proj``: its output, a few hundred units
    wide, goes through a norm over all of them into a column-parallel up-projection, whose input gradient torch's
    style sums over tp; split, it would save little and cost a gather), or a mixture-of-experts router (every rank
    must route every token alike). The coverage check leaves its weight out of the weights a plan must split. Given
    the gathered sequence-parallel stream (a replicated DTensor), it computes on this rank's copy: its output's
    gradient is whole on every rank already."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(lambda module, args: tree_map(whole_local, args))
        return module


def whole_local(value: object) -> object:
    """A DTensor (the gathered sequence-parallel stream, a replicated DTensor) as this rank's whole copy; anything
    else as it is."""
    return value.full_tensor() if isinstance(value, DTensor) else value


class LatentKeyValueProjection(KeptWhole):
    """The down-projection of multi-head latent attention (DeepSeek-V2/V3's ``kv_a_proj_with_mqa``), kept whole.

    Its output is [compressed kv; rotary key]. The compressed part goes through ``kv_b_proj``, column-parallel, whose
    input gradient torch's style sums over tp. The rotary key, one head shared by all, goes straight into attention,
    where each rank uses it for its own heads only: its gradient is partial on each rank and is summed here, on its
    way back into the projection.
    """

    def __init__(self, *, rotary_width: int) -> None:
        super().__init__()
        self.rotary_width = rotary_width

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        super()._apply(module, device_mesh)
        module.register_forward_hook(partial(self._sum_rotary_gradient, device_mesh))
        return module

    def _sum_rotary_gradient(self, device_mesh: DeviceMesh, module: nn.Module, args: tuple, output: torch.Tensor):
        compressed, rotary = output.split([output.shape[-1] - self.rotary_width, self.rotary_width], dim=-1)
        return torch.cat([compressed, summed_gradient(rotary, mesh=device_mesh)], dim=-1)


def summed_gradient(value: torch.Tensor, *, mesh: DeviceMesh) -> torch.Tensor:
    """``value`` itself, whole on every rank; in backward, its gradient (each rank's part) summed over ``mesh``:
    Megatron's copy into the tensor-parallel region."""
    return DTensor.from_local(value, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


class _NamedParameters(ParallelStyle):
    """Some of a module's own parameters, by name, distributed with one placement over tp."""

    placement: Placement

    def __init__(self, *, names: tuple[str, ...]) -> None:
        super().__init__()
        self.names = names

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name in self.names:
            param = getattr(module, name)
            distributed = distribute_tensor(param, device_mesh, [self.placement], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(distributed, requires_grad=param.requires_grad))
        return module


class ReturnedParameters(_NamedParameters):
    """Parameters a module returns for the code around it to compute with (GPT-NeoX-Japanese's attention hands its
    output bias to its block, which adds it to the residual stream).

    Under sequence parallel that code meets the stream, a ``Shard(1)`` DTensor, which computes with DTensors only. As
    replicated DTensors the parameters combine with each rank's slice of the sequence, and DTensor sums their
    gradients over tp.
    """

    placement = Replicate()


class HeadShardedParameters(_NamedParameters):
    """Parameters an attention module keeps per head (GPT-OSS's attention sinks), split with the heads it computes.

    The module's own code combines them with its heads inside attention: once the plan splits the heads, each rank
    needs the entries of its own heads, in order. They become ``Shard(0)`` DTensors (checkpoints keep the whole
    vector), and the module's forward runs on this rank's entries; each entry's gradient comes from its rank alone.
    """

    placement = Shard(0)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        super()._apply(module, device_mesh)
        module.head_sharded_names = self.names
        module.forward = MethodType(_forward_on_local_parameters, module)  # one function for all layers: one graph
        return module


def _forward_on_local_parameters(self: nn.Module, *args, **kwargs):
    """The module's own forward (its class's) on this rank's entries of its head-sharded parameters."""
    with local_parameters(self, names=self.head_sharded_names):
        return type(self).forward(self, *args, **kwargs)


@contextmanager
def local_parameters(
    module: nn.Module,
    local_of: Callable[[DTensor], torch.Tensor] = DTensor.to_local,
    *,
    names: Iterable[str] | None = None,
) -> Iterator[None]:
    """Hand the module's own code this rank's part of its DTensor parameters (``names``, by default all;
    ``local_of``, by default the local shard) for the duration of one call: for code DTensor has no rules for, or
    that mixes them with local tensors."""
    held = dict(module._parameters)
    chosen = set(held if names is None else names)
    try:
        for name, param in held.items():
            if name in chosen and isinstance(param, DTensor):
                module._parameters[name] = local_of(param)
        yield
    finally:
        module._parameters.update(held)
