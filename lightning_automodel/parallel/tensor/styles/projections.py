"""Styles for projections torch's column- and row-wise styles get wrong: fused blocks, transformers' ``Conv1D``, an
embedding whose output model code modifies in place, and projections kept whole on purpose."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from types import MethodType

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.utils._pytree import tree_map

from lightning_automodel.parallel.tensor.styles.parameters import rank_slice, summed_gradient, whole_local


class PackedColwiseParallel(ParallelStyle):
    """Column-parallel for a fused projection of ``parts`` equal blocks: Phi3's [gate; up], [q; k; v] when there are
    as many KV heads as heads (Phi3's qkv_proj, MPT's Wqkv, GPT-2's ``Conv1D`` c_attn).

    Plain column sharding would hand rank 0 all of gate and rank 1 all of up: it runs, and it is wrong. Each
    rank must keep its slice of every block, [gate_r; up_r]. ``_StridedShard(dim, split_factor=parts)`` says
    exactly that (dim 0 of a Linear's weight, dim 1 of a ``Conv1D``'s, stored (in, out)), so the parameter's global
    view stays the Hugging Face layout and checkpoints are unchanged. DTensor has no matmul rule for that placement,
    so the projection runs on local tensors; the input gradient, partial on each rank, is summed over tp on its way
    back. The bias is kept whole on every tp rank, each rank adding its slice of every block and the gradient summed
    over tp: FSDP2 can shard a 1-D tensor on dim 0 only, and its strided description of a dim-0 shard of a packed one
    would shuffle the bias's gradient (Qwen2-VL's vision qkv at tp=2 x dp_shard=2: errors of 1.3).
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
        placements = {"weight": _StridedShard(1 if is_conv1d(module) else 0, split_factor=self.parts)}
        for name, param in list(module.named_parameters(recurse=False)):
            placement = [placements.get(name, Replicate())]
            sharded = distribute_tensor(param, device_mesh, placement, src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.tp_mesh = device_mesh
        module.bias_blocks = Blocks((output_width(module) // self.parts,) * self.parts, (False,) * self.parts)
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
    bias = None
    if self.bias is not None:
        bias = self.bias_blocks.this_ranks(summed_gradient(self.bias.to_local(), mesh=self.tp_mesh), mesh=self.tp_mesh)
    weight = self.weight.to_local()
    return F.linear(hidden, weight.t() if is_conv1d(self) else weight, bias)


@dataclass(frozen=True)
class Blocks:
    """A tensor's dimension laid out as blocks of ``sizes``, each split over tp or, where ``whole``, kept whole."""

    sizes: tuple[int, ...]
    whole: tuple[bool, ...]

    def splits_over(self, tp: int) -> bool:
        return all(whole or size % tp == 0 for size, whole in zip(self.sizes, self.whole, strict=True))

    def this_ranks(self, full: torch.Tensor, *, mesh: DeviceMesh, dim: int = -1) -> torch.Tensor:
        """This rank's part of ``full``, whole on every rank: its slice of every split block, every whole block."""
        pairs = zip(full.split(list(self.sizes), dim=dim), self.whole, strict=True)
        return torch.cat([block if whole else rank_slice(block, mesh=mesh, dim=dim) for block, whole in pairs], dim=dim)


class RegroupedColwiseParallel(ColwiseParallel):
    """Column-parallel for a fused projection of unequal blocks: Phi3's [q; k; v] with grouped KV heads.

    Each rank needs its slice of every block, [q_r; k_r; v_r], but no DTensor placement describes that split
    when the blocks differ in size. The weight is therefore split the plain way (the Hugging Face layout, so
    checkpoints are unchanged), and the outputs are regrouped: one all-gather of the projection output per
    layer, after which each rank keeps its own slice of every block, or the whole of a block marked in ``whole``
    (multi-query attention's single key and value head, which every rank's query heads read). Attention then runs on
    this rank's heads only. The gradients each rank sends back cover only what it kept, so they are summed on the way
    back (a whole block's too: each rank's heads contribute their part of its gradient).
    """

    def __init__(self, *, block_sizes: tuple[int, ...], whole: tuple[bool, ...] | None = None) -> None:
        super().__init__(output_layouts=Shard(-1), use_local_output=False)
        self.blocks = Blocks(tuple(block_sizes), tuple(whole or (False,) * len(block_sizes)))

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return self.blocks.sizes

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not self.blocks.splits_over(device_mesh.size()) or sum(self.block_sizes) % device_mesh.size():
            raise ValueError(
                f"RegroupedColwiseParallel: blocks {self.block_sizes} do not split over {device_mesh.size()} ranks."
            )
        return super()._apply(module, device_mesh)

    def _prepare_output_fn(self, output_layouts, use_local_output, mod, output: DTensor, device_mesh: DeviceMesh):
        """Keep this rank's slice of every block (an instance method: it needs the block sizes)."""
        full = output.redistribute(device_mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        return self.blocks.this_ranks(full, mesh=device_mesh)


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


class OwnedOutputRowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` whose local output is a tensor of its own: torch's is a view made by an autograd Function,
    which model code may not modify in place, and some does (Llama 4's experts block adds the routed experts' output
    into its shared expert's with ``add_``). A DTensor output (sequence parallel) is left as it is."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        output = RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        return output if isinstance(output, DTensor) else output.clone()


class VocabParallelEmbedding(OwnedOutputRowwiseParallel):
    """The vocabulary-parallel embedding of the Llama plan (row-parallel with whole token ids), with an output of its
    own: some model code modifies it in place (CTRL's ``inputs_embeds *= sqrt(d_model)``, GIT's ``embeddings +=
    position_embeddings``)."""

    def __init__(self) -> None:
        super().__init__(input_layouts=Replicate())


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


class WholeKeyValueProjection(KeptWhole):
    """The key or value projection of multi-query attention (a single key/value head every query head reads: Gemma 3
    1B's, a Llama config's with one), kept whole on every rank. Each rank's query heads give its output their part of
    its gradient, summed over tp on the way back."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        super()._apply(module, device_mesh)
        module.register_forward_hook(lambda module, args, output: summed_gradient(output, mesh=device_mesh))
        return module


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
