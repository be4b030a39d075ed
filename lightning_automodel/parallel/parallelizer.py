"""``parallelize``: tensor parallel, activation checkpointing and FSDP2 applied to a model, in that order.

Nothing here knows about Lightning: the same call serves the strategy, Fabric and plain torch scripts.
"""

from __future__ import annotations

import copy
import logging
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_automodel.mesh import axis_size, fsdp_mesh, tp_mesh
from lightning_automodel.parallel.checkpointing import ACMode, apply_activation_checkpointing
from lightning_automodel.parallel.fsdp import apply_fsdp
from lightning_automodel.parallel.lora import lora_aware
from lightning_automodel.parallel.plans import PlanSpec, select_tp_plan, unmatched_patterns, unsharded_linears
from lightning_automodel.parallel.validation import validate_tp_sizes

log = logging.getLogger(__name__)

S = TypeVar("S", bound="ParallelizationStrategy")


class ParallelizationStrategy(ABC):
    """The whole parallelization flow for a model family; see :func:`register_parallelization_strategy`.

    ``options`` are those of :meth:`DefaultParallelizationStrategy.parallelize`.
    """

    @abstractmethod
    def parallelize(self, model: nn.Module, device_mesh: DeviceMesh, **options: Any) -> nn.Module: ...


_STRATEGIES: dict[str, ParallelizationStrategy] = {}


def register_parallelization_strategy(*class_names: str) -> Callable[[type[S]], type[S]]:
    """Class decorator: parallelize models whose class has one of ``class_names`` with this strategy."""

    def register(cls: type[S]) -> type[S]:
        for name in class_names:
            _STRATEGIES[name] = cls()
        return cls

    return register


def parallelization_strategy_for(model: nn.Module) -> ParallelizationStrategy:
    return _STRATEGIES.get(type(model).__name__, DefaultParallelizationStrategy())


def parallelize(model: nn.Module, device_mesh: DeviceMesh, **options: Any) -> nn.Module:
    """Parallelize ``model`` in place over the 5D ``device_mesh`` (see :class:`~lightning_automodel.ParallelDims`)
    with the strategy registered for its class. Options: see :meth:`DefaultParallelizationStrategy.parallelize`.

    A PEFT model is parallelized through the Hugging Face model it wraps, whose module names the plans know.
    """
    hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model
    parallelization_strategy_for(hf_model).parallelize(hf_model, device_mesh, **options)
    return model


class DefaultParallelizationStrategy(ParallelizationStrategy):
    """Tensor parallel, then activation checkpointing, then FSDP2: the flow every family shares."""

    def parallelize(
        self,
        model: nn.Module,
        device_mesh: DeviceMesh,
        *,
        sp: bool = False,
        tp_plan: PlanSpec | None = None,
        activation_checkpointing: bool | ACMode = False,
        mp_policy: MixedPrecisionPolicy | None = None,
        offload_policy: OffloadPolicy | None = None,
        reshard_after_forward: bool | None = None,
        forward_prefetch: int = 0,
        backward_prefetch: int = 1,
        allow_unsharded_linears: bool = False,
    ) -> nn.Module:
        """``activation_checkpointing``: False, True (= "full"), "full", "selective" or "submodule" (see
        :mod:`lightning_automodel.parallel.checkpointing`). ``reshard_after_forward``, ``forward_prefetch`` and
        ``backward_prefetch``: see :func:`lightning_automodel.parallel.fsdp.apply_fsdp`. Parameters the model pins to
        fp32 (Hugging Face's ``_keep_in_fp32_modules_strict``) compute in fp32 under any mixed-precision policy.

        A model with real weights is first made identical on every rank (broadcast from global rank 0):
        tensor parallel scatters sharded weights from rank 0, but FSDP shards each rank's own copy, so
        differently initialised replicas would otherwise mix silently. A model on the meta device is left for
        the caller to materialize after this returns.
        """
        tp = axis_size(device_mesh, "tp")
        if sp and tp == 1:
            raise ValueError("sp=True (sequence parallel) shards activations over the tp axis; it needs tp > 1.")
        if tp > 1:
            validate_tp_sizes(model, tp)
        layers = decoder_layers(model)
        if not is_meta(model):
            model.to(device_mesh.device_type)
            broadcast_from_rank0(model)
        if tp > 1:
            self.apply_tensor_parallel(
                model, tp_mesh(device_mesh), sp=sp, tp_plan=tp_plan, allow_unsharded_linears=allow_unsharded_linears
            )
        if activation_checkpointing:
            apply_activation_checkpointing(model, layers, mode=activation_checkpointing)
        apply_fsdp(
            model,
            layers,
            fsdp_mesh(device_mesh),
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            reshard_after_forward=reshard_after_forward,
            forward_prefetch=forward_prefetch,
            backward_prefetch=backward_prefetch,
            fp32_compute_module_names=fp32_pinned_names(model),
        )
        return model

    def apply_tensor_parallel(self, model: nn.Module, mesh: DeviceMesh, **options: Any) -> None:
        apply_tensor_parallel(model, mesh, **options)


@register_parallelization_strategy("Phi3ForCausalLM")
class Phi3ParallelizationStrategy(DefaultParallelizationStrategy):
    """Phi3 attention slices its fused qkv output with head counts read in forward: make them this rank's
    wherever the plan sharded ``qkv_proj`` (a user plan may keep attention whole)."""

    def apply_tensor_parallel(self, model: nn.Module, mesh: DeviceMesh, **options: Any) -> None:
        super().apply_tensor_parallel(model, mesh, **options)
        for attention in (module for module in model.modules() if hasattr(module, "qkv_proj")):
            weight = attention.qkv_proj.weight
            placements = weight.placements if isinstance(weight, DTensor) else ()
            if not any(isinstance(p, Shard | _StridedShard) for p in placements):
                continue
            attention.config = copy.copy(attention.config)  # the model's own config keeps the global counts
            attention.config.num_attention_heads //= mesh.size()
            attention.config.num_key_value_heads //= mesh.size()
            attention.num_key_value_heads //= mesh.size()


def apply_tensor_parallel(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    sp: bool,
    tp_plan: PlanSpec | None = None,
    allow_unsharded_linears: bool = False,
) -> None:
    """Shard ``model`` with its tensor-parallel plan; ties and frozen parameters survive."""
    plan, source = select_tp_plan(model, sp=sp, tp_plan=tp_plan)
    check_plan_coverage(model, plan, source=source, allow_unsharded_linears=allow_unsharded_linears)
    plan = lora_aware(plan, model)
    log.info("Tensor parallel over %d ranks with the %s", mesh.size(), source)

    requires_grad = {name: p.requires_grad for name, p in model.named_parameters(remove_duplicate=False)}
    ties = _tied_parameter_names(model)
    parallelize_module(model, mesh, plan)
    _retie(model, ties)
    # Some styles (SequenceParallel) re-create parameters as trainable: restore what the user froze.
    for name, param in model.named_parameters(remove_duplicate=False):
        param.requires_grad_(requires_grad[name])


def check_plan_coverage(
    model: nn.Module, plan: Mapping[str, object], *, source: str, allow_unsharded_linears: bool = False
) -> None:
    """Refuse a plan that matches nothing or leaves large Linears of the blocks it shards whole; report
    patterns that match no module (``parallelize_module`` would skip them silently)."""
    unmatched = unmatched_patterns(model, plan)
    if len(unmatched) == len(plan):
        raise ValueError(
            f"The {source} matches no module of {type(model).__name__}: {sorted(plan)}. Pass tp_plan= with"
            " patterns over the names in model.named_modules()."
        )
    if unmatched:
        log.warning("Tensor-parallel plan patterns that match no module of %s: %s", type(model).__name__, unmatched)
    whole = unsharded_linears(model, plan)
    if whole and not allow_unsharded_linears:
        shown = ", ".join(whole[:6]) + (f" and {len(whole) - 6} more" if len(whole) > 6 else "")
        raise ValueError(
            f"The {source} leaves large Linear layers of the blocks it shards unsharded: {shown}. Every tp rank"
            " would hold and compute them in full. Add them to tp_plan=, or pass allow_unsharded_linears=True if"
            " that is intended."
        )


def fp32_pinned_names(model: nn.Module) -> tuple[str, ...]:
    """Names the model's authors require to stay fp32 even in a bf16 or fp16 model (Hugging Face's
    ``_keep_in_fp32_modules_strict``, which a model gathers from its submodules too)."""
    return tuple(sorted(getattr(model, "_keep_in_fp32_modules_strict", None) or ()))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks, in registration order: the items of every ModuleList that hold parameters
    (``model.layers`` in Hugging Face models, and a vision tower's encoder layers in multimodal ones)."""
    return [
        block
        for module in model.modules()
        if isinstance(module, nn.ModuleList)
        for block in module
        if not isinstance(block, nn.ModuleList) and any(True for _ in block.parameters())
    ]


def is_meta(model: nn.Module) -> bool:
    """Whether ``model`` was built on the meta device; a model only partly on meta is refused.

    Materializing re-allocates every tensor, so the real weights of a half-meta model would be lost.
    """
    on_meta = [t.is_meta for t in _tensors(model)]
    if any(on_meta) and not all(on_meta):
        raise ValueError(
            f"{type(model).__name__} has tensors both on the meta device and real ones. Build the whole model"
            " under `with torch.device('meta'):`, or build it with real weights."
        )
    return any(on_meta)


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
