"""Expert tensor parallel: the experts of a mixture-of-experts layer, transformers 5's fused 3D parameters (or DBRX's
stacked 2D ones), split on their intermediate units: the Megatron MLP layout applied to every expert at once.
"""

from __future__ import annotations

from contextlib import ExitStack
from functools import partial
from types import MethodType
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.utils._pytree import tree_map

from lightning_automodel.parallel.tensor.styles.parameters import (
    local_parameters,
    localize_sizes,
    summed_gradient,
    whole_local,
)

# The parameters of an experts module, as (name, the dim holding intermediate units when stored (out, in)).
_UP = {"gate_up_proj": 1, "up_proj": 1}
_DOWN = {"down_proj": 2}
# DBRX's experts: every expert's gate, up and down projections stacked into one (experts x intermediate, hidden) matrix
# each, held by a child ``mlp``.
_STACKED = ("w1", "v1", "w2")


def is_experts(module: nn.Module) -> bool:
    """A module holding a layer's experts as fused 3D parameters: ``gate_up_proj`` or ``up_proj``, and ``down_proj``."""
    params = dict(module.named_parameters(recurse=False))
    up = [name for name in _UP if name in params]
    return len(up) == 1 and "down_proj" in params and all(params[name].ndim == 3 for name in (*up, "down_proj"))


def is_stacked_experts(module: nn.Module) -> bool:
    """DBRX's experts module: ``num_experts`` experts of ``ffn_hidden_size`` units, stacked in ``mlp``'s matrices."""
    mlp = getattr(module, "mlp", None)
    sizes = [getattr(module, name, None) for name in ("num_experts", "ffn_hidden_size", "hidden_size")]
    if not isinstance(mlp, nn.Module) or not all(isinstance(size, int) for size in sizes):
        return False
    params = dict(mlp.named_parameters(recurse=False))
    shape = (sizes[0] * sizes[1], sizes[2])
    return set(params) == set(_STACKED) and all(tuple(p.shape) == shape for p in params.values())


def experts_problem(module: nn.Module) -> str | None:
    """Why :class:`ExpertTensorParallel` cannot split ``module``, or None."""
    if is_stacked_experts(module):
        extra = [name for name, child in module.mlp.named_children() if not _is_activation(child)]
        return f"{type(module).__name__} computes more than its experts' weighted sum ({extra})" if extra else None
    if not is_experts(module):
        return (
            f"it splits experts held as 3D gate_up_proj/up_proj and down_proj parameters, not a {type(module).__name__}"
        )
    known = {*_UP, *_DOWN, *(f"{name}_bias" for name in (*_UP, *_DOWN))}
    unknown = sorted({name for name, _ in module.named_parameters()} - known)
    if unknown:
        return f"{type(module).__name__} also holds {unknown}, which it does not know how to split"
    # Anything after down_proj but the weighted sum (a norm per expert, identity experts) would see partial sums.
    extra = [name for name, child in module.named_children() if not _is_activation(child)]
    if getattr(module, "has_post_expert_norm", False) or extra:
        return f"{type(module).__name__} computes more than its experts' weighted sum ({extra or 'a post-expert norm'})"
    return None


def _is_activation(module: nn.Module) -> bool:
    """An activation function module (transformers' or torch's), which acts element by element."""
    where = type(module).__module__
    return where.startswith("transformers.activations") or where.startswith("torch.nn.modules.activation")


class ExpertTensorParallel(ParallelStyle):
    """Split every expert of an experts module on its intermediate units over tp.

    transformers 5 keeps a layer's experts in one module: ``gate_up_proj`` (or ``up_proj`` where there is no gate) and
    ``down_proj``, experts on dim 0, stored (out, in) per expert, or (in, out) where the module is ``is_transposed``
    (GPT-OSS, Aria, Llama 4). Each rank keeps every expert's rows of gate and of up (a strided placement for the halves
    of a concatenated ``gate_up_proj``, a plain one for GPT-OSS's interleaved columns) and the matching inputs of
    ``down_proj``; the router and token dispatch stay whole and identical on every rank, and the partial outputs are
    summed over tp once per layer.

    The module's own forward runs on this rank's local parameters (DTensor has no rules for the routing ops). Its
    inputs, the tokens and routing weights, are whole on every rank, so their gradients are summed over tp on the way
    back: the router gets the gradient of the whole layer. A bias of ``down_proj`` (GPT-OSS) is added as a 1/tp share
    by each rank, so that the sum adds it once. DBRX's stacked experts keep every expert's rows of its three matrices
    (a strided placement, one stride per expert), and its code's ``ffn_hidden_size`` becomes this rank's.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        problem = experts_problem(module)
        if problem is not None:
            raise TypeError(f"ExpertTensorParallel: {problem}.")
        tp = device_mesh.size()
        stacked = is_stacked_experts(module)
        placements = _stacked_placements(module, tp=tp) if stacked else expert_placements(module, tp=tp)
        if stacked:  # its code views the matrices by this rank's units per expert
            localize_sizes(module, {"ffn_hidden_size": module.ffn_hidden_size // tp})
        for name, placement in placements.items():
            owner, _, attribute = name.rpartition(".")
            owner = module.get_submodule(owner)
            param = getattr(owner, attribute)
            sharded = distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank)
            owner.register_parameter(attribute, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.tp_mesh = device_mesh
        module.forward = MethodType(_local_forward, module)  # one function for all layers: one compiled graph
        return module


def expert_placements(module: nn.Module, *, tp: int) -> dict[str, Placement]:
    """Each parameter's placement over tp. Raises a ValueError if the intermediate units do not split evenly."""
    transposed = bool(module.is_transposed) if hasattr(module, "is_transposed") else _stored_in_out(module)
    interleaved = not getattr(module, "is_concatenated", True)
    placements: dict[str, Placement] = {}
    for name, param in module.named_parameters(recurse=False):
        weight = name.removesuffix("_bias")
        if weight in _DOWN and name != weight:
            placements[name] = Replicate()  # a 1/tp share added by each rank (see _this_ranks_part)
            continue
        dim = _intermediate_dim(weight, transposed=transposed, bias=name != weight)
        packed = weight == "gate_up_proj" and not interleaved
        if param.shape[dim] % (tp * (2 if packed else 1)):
            raise ValueError(
                f"ExpertTensorParallel: {name} has {param.shape[dim]} intermediate units, which do not split"
                f" {'as two halves ' if packed else ''}over {tp} tp ranks."
            )
        placements[name] = _StridedShard(dim, split_factor=2) if packed else Shard(dim)
    return placements


def _stacked_placements(module: nn.Module, *, tp: int) -> dict[str, Placement]:
    """DBRX's stacked experts: each rank keeps every expert's slice of its units."""
    if module.ffn_hidden_size % tp:
        raise ValueError(
            f"ExpertTensorParallel: {module.ffn_hidden_size} intermediate units per expert do not split over tp={tp}."
        )
    return {f"mlp.{name}": _StridedShard(0, split_factor=module.num_experts) for name in _STACKED}


def _intermediate_dim(weight: str, *, transposed: bool, bias: bool) -> int:
    if bias:
        return 1  # (experts, out)
    dim = {**_UP, **_DOWN}[weight]
    return 3 - dim if transposed else dim


def _stored_in_out(module: nn.Module) -> bool:
    """For experts modules without transformers' layout flags (Llama 4): stored (in, out) when the hidden size is dim
    1 of the up projection and dim 2 of ``down_proj``; (out, in) when it is dim 2 and dim 1. Refused if both fit."""
    up = module.gate_up_proj if "gate_up_proj" in module._parameters else module.up_proj
    down = module.down_proj
    in_out, out_in = up.shape[1] == down.shape[2], up.shape[2] == down.shape[1]
    if in_out == out_in:
        raise ValueError(
            f"ExpertTensorParallel: the shapes of {type(module).__name__}'s experts ({tuple(up.shape)},"
            f" {tuple(down.shape)}) do not say whether they are stored (out, in) or (in, out), and the module does not"
            " say (transformers' is_transposed). Pass tp_plan= with a style for it, or use tp=1."
        )
    return in_out


def _local_forward(self: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The module's own forward (its class's) on this rank's parameters; the partial outputs summed over tp, into a
    tensor of their own (a view made by DTensor's autograd Function may not be modified in place, and Llama 4 adds to
    it)."""
    mesh = self.tp_mesh
    args, kwargs = tree_map(partial(_whole_input, mesh=mesh), (args, kwargs))
    with ExitStack() as stack:
        for owner in (self, *self.children()):  # DBRX's experts hold their parameters in a child
            stack.enter_context(local_parameters(owner, partial(_this_ranks_part, mesh=mesh)))
        output = type(self).forward(self, *args, **kwargs)
    summed = DTensor.from_local(output, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()])
    return summed.to_local().clone()


def _whole_input(value: Any, *, mesh: DeviceMesh) -> Any:
    """A floating-point tensor every rank holds whole, whose gradient (partial on each rank) is summed over tp."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return value
    return summed_gradient(whole_local(value), mesh=mesh)


def _this_ranks_part(param: DTensor, *, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's slice of an expert weight; of a ``down_proj`` bias replicated over tp, a 1/tp share."""
    if param.placements[-1].is_replicate():  # tp is the last axis of the experts' mesh, (ep, tp) under ep
        return summed_gradient(param.to_local(), mesh=mesh) / mesh.size()
    return param.to_local()
