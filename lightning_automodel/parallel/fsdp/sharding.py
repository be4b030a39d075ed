"""FSDP2 sharding: one unit per decoder layer, then a multimodal model's vision tower and projector, then the root,
each cut by compute dtype."""

from __future__ import annotations

import logging
import re
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from lightning_automodel.hf.decoder_layers import layers_sharing_parameters
from lightning_automodel.parallel.fsdp.dtypes import compute_dtype_resolver, iter_maximal_uniform_dtype_subtrees
from lightning_automodel.parallel.fsdp.options import FSDPOptions

log = logging.getLogger(__name__)


@contextmanager
def view_outputs_allowed(*classes: str) -> Iterator[None]:
    """Calls of FSDP2 units whose outputs are views, which FSDP2 warns an in-place op could detach from their backward
    hook, made without the warning: for calls whose outputs nothing writes to in place. ``classes``: the units' class
    names (default: any unit)."""
    names = "|".join(re.escape(name) for name in classes) if classes else ".*"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=rf"FSDP2-wrapped module \(({names})\) returned a view tensor")
        yield


@dataclass(frozen=True)
class ExpertSharding:
    """Experts modules distributed over ep (expert parallel), which FSDP shards over a mesh of their own ("efsdp").

    Each expert's gradient already sums the contributions of every ep rank's tokens, so the reduction divides it by
    the whole data-parallel size (``gradient_divide_factor``), as the dense weights' reduction over their own larger
    mesh does, rather than by the size of the experts' mesh.
    """

    modules: Sequence[nn.Module]
    mesh: DeviceMesh
    gradient_divide_factor: int

    def within(self, root: nn.Module) -> ExpertSharding:
        """Those of the experts modules ``root`` holds: a pipeline rank's stages are roots of their own, each
        sharding its own experts."""
        held = {id(module) for module in root.modules()}
        return replace(self, modules=[module for module in self.modules if id(module) in held])


def apply_fsdp(
    model: nn.Module,
    layers: Sequence[nn.Module],
    mesh: DeviceMesh,
    options: FSDPOptions,
    *,
    experts: ExpertSharding | None = None,
    parts: Sequence[nn.Module] = (),
    fp32_compute_module_names: Iterable[str] = (),
) -> None:
    """Shard each decoder layer, then each of ``parts`` (a multimodal model's vision tower and projector, whose
    gathers and reductions then leave the root's), then the root, with :func:`fully_shard_by_dtype`, as ``options``
    say. A layer or part sharing a parameter with another or the rest of the model (see
    :func:`~hf.decoder_layers.layers_sharing_parameters`) is no unit of its own: the root holds it. ``experts``
    (expert parallel) are units of their own, inside their layers, over their own mesh."""
    shared = [*layers_sharing_parameters(model, layers), *layers_sharing_parameters(model, parts)]
    if shared:
        log.info(
            "%d decoder layers or parts share parameters with others: the unit around them holds them", len(shared)
        )
    layers = [layer for layer in layers if not any(layer is s for s in shared)]
    parts = [part for part in parts if not any(part is s for s in shared)]
    policies = dict(
        mp_policy=options.mp_policy,
        offload_policy=options.offload_policy,
        fp32_compute_module_names=tuple(fp32_compute_module_names),
    )
    reshard_after_forward = options.reshard_after_forward
    if experts is not None:
        shard_experts(experts, reshard_after_forward=reshard_after_forward is not False, **policies)
    for index, layer in enumerate(layers):
        last = index == len(layers) - 1
        fully_shard_by_dtype(
            layer,
            mesh=mesh,
            reshard_after_forward=not last if reshard_after_forward is None else reshard_after_forward,
            **policies,
        )
    for part in parts:  # called before the language model's blocks: its weights are not needed again until backward
        fully_shard_by_dtype(part, mesh=mesh, reshard_after_forward=reshard_after_forward is not False, **policies)
    fully_shard_by_dtype(model, mesh=mesh, reshard_after_forward=bool(reshard_after_forward), **policies)
    ahead, behind = options.forward_prefetch, options.backward_prefetch
    for index, layer in enumerate(layers):
        if ahead > 0:
            layer.set_modules_to_forward_prefetch(list(layers[index + 1 : index + 1 + ahead]))
        if behind > 1:
            layer.set_modules_to_backward_prefetch(list(layers[max(0, index - behind) : index][::-1]))


def shard_experts(experts: ExpertSharding, **options: object) -> None:
    """Shard each experts module over ``experts.mesh`` (``options``: those of :func:`fully_shard_by_dtype`)."""
    # A custom factor makes FSDP scale inside its reduce-scatter (NCCL's PreMulSum), which gloo lacks: there it sums
    # and scales apart. Not over one rank, where it skips the reduce-scatter and would divide twice (torch 2.13).
    shard_group = experts.mesh.get_group(experts.mesh.ndim - 1)
    sum_then_scale = dist.get_backend(shard_group) == "gloo" and shard_group.size() > 1
    for module in experts.modules:
        fully_shard_by_dtype(module, mesh=experts.mesh, **options)
        for unit in module.modules():
            if isinstance(unit, FSDPModule):
                unit.set_gradient_divide_factor(experts.gradient_divide_factor)
                unit.set_force_sum_reduction_for_comms(sum_then_scale)


def fully_shard_by_dtype(
    module: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    fp32_compute_module_names: tuple[str, ...] = (),
    reshard_after_forward: bool = True,
) -> FSDPModule:
    """``fully_shard`` ``module`` so that every parameter computes in the dtype it needs.

    Parameters are grouped by compute dtype (see :func:`~parallel.fsdp.dtypes.compute_dtype_resolver`;
    ``fp32_compute_module_names`` pins names to fp32), and each FSDP unit holds one group:

    * one dtype: ``module`` is one unit;
    * two: the minority dtype's largest uniform submodules are units of their own, then ``module`` holds the rest;
    * three or more: every largest uniform submodule is a unit, then ``module`` holds what is left.

    A unit computing in another dtype than the policy's (an fp32 router in a bf16 model) gathers, computes,
    reduces gradients and returns outputs in that dtype. Parameters already sharded by an inner
    ``fully_shard`` are left to it. A parameter that no unit can hold alone, because it sits directly in a module
    beside parameters of another dtype, is an error naming it, raised before ``module`` is sharded.
    """
    policy = mp_policy or MixedPrecisionPolicy()
    dtype_of = compute_dtype_resolver(
        module, param_dtype=policy.param_dtype, fp32_module_names=fp32_compute_module_names
    )
    claimed = _sharded_parameter_ids(module)
    planned = []
    for unit, dtype in dtype_units(module, dtype_of):  # storage dtypes read before sharding replaces parameters
        own = [p for p in unit.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in own)
        planned.append((unit, _policy_for(policy, dtype, storage={p.dtype for p in own})))
    for unit, unit_policy in planned:
        fully_shard(
            unit,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=unit_policy,
            offload_policy=offload_policy or OffloadPolicy(),
            shard_placement_fn=_shard_placement,
        )
    return module


def dtype_units(
    module: nn.Module, dtype_of: Callable[[torch.Tensor], torch.dtype]
) -> list[tuple[nn.Module, torch.dtype | None]]:
    """The FSDP units ``module`` is cut into, innermost first, with the compute dtype of each; ``module`` last."""
    sharded = _sharded_parameter_ids(module)
    params = [p for p in module.parameters() if id(p) not in sharded]
    numel_by_dtype = Counter[torch.dtype]()
    for param in params:
        numel_by_dtype[dtype_of(param)] += param.numel()
    if len(numel_by_dtype) <= 1:
        return [(module, next(iter(numel_by_dtype), None))]

    majority = max(numel_by_dtype, key=numel_by_dtype.__getitem__)
    subtrees = iter_maximal_uniform_dtype_subtrees(
        module, include_buffers=False, tensor_pred=lambda p: id(p) not in sharded, dtype_of=dtype_of
    )
    if len(numel_by_dtype) == 2:  # the bulk stays one unit; only the minority is cut out
        units = [(sub, dtype) for sub, dtype in subtrees if dtype != majority]
    else:  # with several dtypes ``module`` itself is never uniform
        units = list(subtrees)
    units = [(unit, dtype) for sub, dtype in units for unit in _with_forward(sub)]
    in_units = {id(p) for sub, _ in units for p in sub.parameters()}
    rest = [p for p in params if id(p) not in in_units]
    rest_dtypes = {dtype_of(p) for p in rest}
    if len(rest_dtypes) > 1:
        raise ValueError(_inseparable_message(module, rest, dtype_of))
    return [*units, (module, next(iter(rest_dtypes), majority))]


def _sharded_parameter_ids(module: nn.Module) -> set[int]:
    """Parameters already sharded by an inner ``fully_shard`` (a decoder layer, when sharding the root)."""
    return {id(p) for m in module.modules() if m is not module and isinstance(m, FSDPModule) for p in m.parameters()}


def _with_forward(module: nn.Module) -> list[nn.Module]:
    """``module``, or for a container with no forward of its own (a ModuleDict of LoRA adapters), the modules it
    holds: FSDP hooks run around forward calls."""
    if type(module).forward is not nn.Module.forward:
        return [module]
    return [unit for child in module.children() for unit in _with_forward(child)]


def _inseparable_message(module: nn.Module, params: list[nn.Parameter], dtype_of: Callable) -> str:
    names = {id(p): name for name, p in module.named_parameters()}
    by_dtype: dict[torch.dtype, list[str]] = {}
    for param in params:
        by_dtype.setdefault(dtype_of(param), []).append(names[id(param)])
    listed = "; ".join(f"{dtype}: {', '.join(sorted(group)[:4])}" for dtype, group in by_dtype.items())
    return (
        f"FSDP2 cannot shard {type(module).__name__} by dtype: these parameters compute in different dtypes but sit"
        f" directly in the same modules, so no FSDP unit can hold one dtype alone ({listed}). Cast them to one dtype"
        " (e.g. module.to(torch.bfloat16)), or move the parameters that must keep their own dtype into a submodule"
        " of their own."
    )


def _policy_for(
    policy: MixedPrecisionPolicy, dtype: torch.dtype | None, *, storage: set[torch.dtype]
) -> MixedPrecisionPolicy:
    """The policy itself if under it the unit computes in ``dtype`` already (the policy's dtype, or with none,
    its one storage dtype); otherwise one that keeps ``dtype`` throughout (a pinned fp32 router stored in bf16)."""
    computes_in = policy.param_dtype or (next(iter(storage)) if len(storage) == 1 else None)
    if dtype is None or computes_in == dtype:
        return policy
    return replace(policy, param_dtype=dtype, reduce_dtype=dtype, output_dtype=dtype)


def _shard_placement(param: nn.Parameter) -> Shard | None:
    """Shard a weight tensor parallel splits block by block on dim 0 (a packed Linear) on dim 1; every other
    parameter on dim 0 (FSDP's default), those packed on another dim included (Conv1D's (in, out) weight, experts).

    FSDP describes a dim-0 shard of a tensor-parallel shard as a strided shard that assumes the tp placement is
    a plain ``Shard(0)``. For a packed projection (tp placement ``_StridedShard(0)``) that description would
    be wrong: gathering the DTensor (``full_tensor``, checkpoints) would shuffle the rows. On another dim the two
    placements compose without ambiguity.
    """
    if isinstance(param, DTensor) and param.ndim > 1 and any(_strided_on(p, 0) for p in param.placements):
        return Shard(1)
    return None


def _strided_on(placement: Placement, dim: int) -> bool:
    return isinstance(placement, _StridedShard) and placement.dim == dim
