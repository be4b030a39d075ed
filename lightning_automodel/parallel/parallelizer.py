"""``parallelize``: tensor parallel, activation checkpointing and FSDP2 applied to a model, in that order.

Nothing here knows about Lightning: the same call serves the strategy, Fabric and plain torch scripts.
"""

from __future__ import annotations

import dataclasses
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor

from lightning_automodel.hf.decoder_layers import named_decoder_layers
from lightning_automodel.parallel.activation_checkpointing import ACMode, apply_activation_checkpointing
from lightning_automodel.parallel.compile import (
    CompileSpec,
    apply_compile,
    check_compile,
    compile_options,
)
from lightning_automodel.parallel.context_parallel import (
    CPAttention,
    check_cp_with_pp,
    context_parallel_model,
    context_parallel_problem,
)
from lightning_automodel.parallel.experts.expert_parallel import (
    apply_expert_parallel,
    expert_parallel_problem,
    expert_precision_problem,
    experts_modules,
)
from lightning_automodel.parallel.experts.tensor_parallel import give_every_expert_a_gradient
from lightning_automodel.parallel.fsdp.sharding import ExpertSharding, apply_fsdp
from lightning_automodel.parallel.mesh import axis_size, expert_fsdp_mesh, expert_mesh, fsdp_mesh, tp_mesh
from lightning_automodel.parallel.pipeline import (
    PipelineOptions,
    name_of,
    pipeline_model,
    pipeline_problem,
    stage_split_problem,
)
from lightning_automodel.parallel.probe import ProbeError, Trace, meta_copy, probe, refuses_length, sequence_lengths
from lightning_automodel.parallel.tensor.apply import (
    TensorParallelPlan,
    apply_tensor_parallel,
    plan_tensor_parallel,
)
from lightning_automodel.parallel.tensor.plans import PlanSpec
from lightning_automodel.parallel.tensor.sequence_parallel import stage_stream_boundaries, stream_placements
from lightning_automodel.parallel.tensor.sizes import validate_tp_sizes

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
    """Tensor parallel, expert parallel, then activation checkpointing, then FSDP2: the flow every family shares."""

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
        pipeline: PipelineOptions | None = None,
        cp_attention: CPAttention = "auto",
        compile: CompileSpec = False,
    ) -> nn.Module:
        """``activation_checkpointing``: False, True (= "full"), "full", "selective" or "submodule" (see
        :mod:`parallel.activation_checkpointing`). ``reshard_after_forward``, ``forward_prefetch`` and
        ``backward_prefetch``: see :func:`parallel.fsdp.sharding.apply_fsdp` (under pp, None is False: a
        stage gathers its weights once a step). ``cp_attention``: the
        attention kernel at cp > 1 (see :mod:`lightning_automodel.parallel.context_parallel`). ``compile``: False,
        True or a dict of ``torch.compile``'s arguments, for every decoder block (see
        :mod:`lightning_automodel.parallel.compile`). ``pipeline``: how the
        mesh's pp ranks split the model into stages and run them (default at pp > 1: :class:`PipelineOptions`'s); see
        :mod:`lightning_automodel.parallel.pipeline`. Without the strategy, a pipelined model built on the meta
        device or with tied embeddings needs ``pipeline_of(model).adopt_weights()`` once its weights exist, and
        ``.sum_tied_gradients()`` before each optimizer step. Parameters the model pins to fp32 (Hugging Face's
        ``_keep_in_fp32_modules_strict``) compute in fp32 under any mixed-precision policy.

        Every check that can refuse runs first, on every rank, before any collective: sizes, the tensor-parallel plan
        and a probe step of the model on the meta device (see :mod:`lightning_automodel.parallel.tensor.apply`).
        A model with real weights is then made identical on every rank (broadcast from global rank 0): tensor
        parallel scatters sharded weights from rank 0, but FSDP shards each rank's own copy, so differently
        initialised replicas would otherwise mix silently. A model on the meta device is left for the caller to
        materialize after this returns.
        """
        meta = is_meta(model)
        compiled = compile_options(compile)
        check_compile(
            compile=compile, activation_checkpointing=activation_checkpointing, ep=axis_size(device_mesh, "ep")
        )
        pp = axis_size(device_mesh, "pp")
        pipeline = (pipeline or PipelineOptions()) if pp > 1 else None
        checked = check_before_collectives(
            model,
            device_mesh,
            pipeline=pipeline,
            sp=sp,
            tp_plan=tp_plan,
            allow_unsharded_linears=allow_unsharded_linears,
            reshard_after_forward=reshard_after_forward,
            activation_checkpointing=bool(activation_checkpointing),
        )
        ep = axis_size(device_mesh, "ep")
        reduce_dtype = (mp_policy.reduce_dtype or mp_policy.param_dtype) if mp_policy else None
        problem = expert_precision_problem(model, reduce_dtype) if ep > 1 else None
        if problem is not None:
            raise ValueError(f"ep={ep} (expert parallel): {problem}.")
        if not meta:
            model.to(device_mesh.device_type)
            broadcast_from_rank0(model)
        planned = checked.planned
        stages = None
        if pipeline is not None:
            embedding = name_of(model, model.get_input_embeddings())
            stages = pipeline_model(model, device_mesh, pipeline)
            if planned is not None:
                blocks_list = named_decoder_layers(model)[0][0].rsplit(".", 1)[0]
                blocks = [[f"{blocks_list}.{index}" for index in layers] for layers in stages.layers.values()]
                planned = dataclasses.replace(planned, styles=stage_stream_boundaries(planned.styles, blocks))
                stages.receive_stream_as(tp_mesh(device_mesh), stream_placements(planned.styles, embedding))
        if axis_size(device_mesh, "cp") > 1:
            context_parallel_model(model, device_mesh, attention=cp_attention)
        layers = [layer for name, layer in named_decoder_layers(model) if name not in checked.held_by_root]
        if planned is not None:
            apply_tensor_parallel(model, tp_mesh(device_mesh), planned)
        experts = None
        if ep > 1:
            apply_expert_parallel(model, expert_mesh(device_mesh))
            modules = [module for _, module in experts_modules(model)]
            experts = ExpertSharding(modules, expert_fsdp_mesh(device_mesh), axis_size(device_mesh, "dp_cp"))
        if activation_checkpointing:
            apply_activation_checkpointing(model, layers, mode=activation_checkpointing)
        if compiled is not None:
            apply_compile(model, layers, compiled)
        give_every_expert_a_gradient(model)
        if stages is not None and reshard_after_forward is None:
            # torch's stage keeps a stage's weights gathered from each micro-batch's backward to the last: freeing them
            # after each forward would gather them again for the next micro-batch's forward and backward.
            reshard_after_forward = False
        for root in stages.stage_modules() if stages is not None else [model]:  # a root per stage a rank holds
            apply_fsdp(
                root,
                [layer for name, layer in named_decoder_layers(root) if name not in checked.held_by_root],
                fsdp_mesh(device_mesh),
                experts=experts.within(root) if experts is not None else None,
                mp_policy=mp_policy,
                offload_policy=offload_policy,
                reshard_after_forward=reshard_after_forward,
                forward_prefetch=forward_prefetch,
                backward_prefetch=backward_prefetch,
                fp32_compute_module_names=fp32_pinned_names(model),
            )
        return model


@dataclass(frozen=True)
class Checked:
    """What the checks before any collective found, for the sharding that follows."""

    planned: TensorParallelPlan | None  # the tensor-parallel plan; None at tp = 1
    held_by_root: tuple[str, ...] = ()  # blocks recomputed outside their calls: no FSDP units of their own


def check_before_collectives(
    model: nn.Module,
    device_mesh: DeviceMesh,
    *,
    sp: bool = False,
    tp_plan: PlanSpec | None = None,
    allow_unsharded_linears: bool = False,
    reshard_after_forward: bool | None = None,
    activation_checkpointing: bool = False,
    pipeline: PipelineOptions | None = None,
) -> Checked:
    """Every check of :meth:`DefaultParallelizationStrategy.parallelize` that can refuse, run without a collective:
    sizes, a probe step of the model on the meta device, and at tp > 1 the tensor-parallel plan it then applies.
    :func:`~lightning_automodel.planning.verify.verify_plan` shares it, so that what it verifies is the plan training
    gets."""
    tp = axis_size(device_mesh, "tp")
    if sp and tp == 1:
        raise ValueError("sp=True (sequence parallel) shards activations over the tp axis; it needs tp > 1.")
    if tp > 1:
        validate_tp_sizes(model, tp)
    ep = axis_size(device_mesh, "ep")
    problem = expert_parallel_problem(model, ep=ep) if ep > 1 else None
    if problem is not None:
        raise ValueError(f"ep={ep} (expert parallel): {problem}. Use ep=1 for this model.")
    pp = axis_size(device_mesh, "pp")
    if pp > 1:
        check_pipeline(
            model, pipeline or PipelineOptions(), pp=pp, ep=ep, activation_checkpointing=activation_checkpointing
        )
    cp = axis_size(device_mesh, "cp")
    if cp > 1:
        check_context_parallel(model, cp=cp, pp=pp)
    unsharded = probe_unsharded(model, tp=tp)  # at tp = 1 it only adds a check: a model it cannot run goes on
    recomputed = blocks_recomputed_outside_calls(model, unsharded) if isinstance(unsharded, Trace) else ()
    if recomputed and (reshard_after_forward or activation_checkpointing):
        undoing = "reshard_after_forward=True" if reshard_after_forward else "activation checkpointing"
        raise ValueError(
            f"{type(model).__name__} runs {recomputed[0]} without autograd in its training forward and recomputes it"
            " in backward without calling it (a reversible block): FSDP2 gathers a unit's weights around its calls"
            " only, so such blocks belong to the root's unit, whose weights stay gathered from forward through"
            f" backward. {undoing} would recompute them on sharded weights: leave reshard_after_forward unset and"
            " activation_checkpointing off."
        )
    if tp == 1:
        return Checked(None, held_by_root=recomputed)
    planned = plan_tensor_parallel(
        model,
        tp_mesh(device_mesh),
        sp=sp,
        tp_plan=tp_plan,
        allow_unsharded_linears=allow_unsharded_linears,
        unsharded=unsharded,
    )
    return Checked(planned, held_by_root=recomputed)


def check_pipeline(
    model: nn.Module, pipeline: PipelineOptions, *, pp: int, ep: int, activation_checkpointing: bool = False
) -> None:
    """At pp > 1: the options suit the model, which splits into stages that compute what it computes whole (see
    :mod:`lightning_automodel.parallel.pipeline`)."""
    pipeline.validate(pp, num_layers=len(named_decoder_layers(model)))
    if activation_checkpointing and pipeline.splits_backward():
        raise ValueError(
            f"pp_schedule={pipeline.schedule!r} computes the weights' gradients apart from the inputs' (zero bubble),"
            " which recomputes a checkpointed layer twice: torch's checkpoint fails there. Use"
            " pp_schedule='Interleaved1F1B', or activation_checkpointing=False."
        )
    problem = pipeline_problem(model, pp=pp, stages_per_rank=pipeline.stages_per_rank) or stage_split_problem(model)
    if problem is not None:
        raise ValueError(f"pp={pp} (pipeline parallel): {problem}. Use pp=1 for this model.")


def check_context_parallel(model: nn.Module, *, cp: int, pp: int) -> None:
    """At cp > 1: the model splits its sequences over cp ranks and computes what it computes whole (see
    :mod:`lightning_automodel.parallel.context_parallel`); pipeline parallel is off (not composed with it yet)."""
    check_cp_with_pp(cp=cp, pp=pp)
    problem = context_parallel_problem(model)
    if problem is not None:
        raise ValueError(f"cp={cp} (context parallel): {problem}. Use cp=1 for this model.")


def probe_unsharded(model: nn.Module, *, tp: int) -> Trace | ProbeError | None:
    """One step of a meta-device copy of the Hugging Face ``model`` (see :mod:`lightning_automodel.parallel.probe`),
    or how it failed at every sequence length tried. Models that are not Hugging Face ones, whose inputs are
    unknown, are not probed (None)."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return None
    failure = None
    for tokens in sequence_lengths(model, tp=tp):
        try:
            return probe(meta_copy(model), tokens=tokens)
        except ProbeError as error:
            failure = failure or error
            if not refuses_length(error):
                break
    log.debug("The meta-device probe of %s failed: %s", type(model).__name__, failure)
    return failure


def blocks_recomputed_outside_calls(model: nn.Module, unsharded: Trace) -> tuple[str, ...]:
    """The decoder blocks a training forward runs without autograd and backward recomputes without calling them
    (Reformer's reversible layers): FSDP2 gathers a unit's weights around its calls only, so as units of their own
    they would be recomputed on sharded weights. A block recomputed by calling it again (checkpointing) is fine."""
    found = []
    for name, block in named_decoder_layers(model):
        calls = unsharded.calls.get(name, [])
        trains = any(p.requires_grad for p in block.parameters())
        recomputed_by_a_call = name in unsharded.called_in_backward
        if calls and trains and not any(call.grad_enabled for call in calls) and not recomputed_by_a_call:
            found.append(name)
    return tuple(found)


def fp32_pinned_names(model: nn.Module) -> tuple[str, ...]:
    """Names the model's authors require to stay fp32 even in a bf16 or fp16 model (Hugging Face's
    ``_keep_in_fp32_modules_strict``, which a model gathers from its submodules too)."""
    return tuple(sorted(getattr(model, "_keep_in_fp32_modules_strict", None) or ()))


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
