"""``parallelize``: a model's parallel layout applied in this order, each step where the mesh and the options ask for
it (see :meth:`DefaultParallelizationStrategy.parallelize`):

1. every check that can refuse, before any collective: sizes, the tensor-parallel plan, a probe step on meta
2. real weights made the same on every rank (broadcast from rank 0); a model on meta is materialized by the caller
3. pipeline stages (pp): this rank's stages kept
4. context parallel (cp)
5. float8 linear layers (torchao; under tensorwise scaling, torchao's tensor-parallel styles for them)
6. tensor and sequence parallel (tp, sp)
7. expert parallel (ep)
8. activation checkpointing
9. torch.compile per decoder block
10. experts no token reached given a zero gradient, for FSDP2's reduction
11. FSDP2 / HSDP, by dtype

It returns a :class:`~lightning_automodel.parallel.parallelized.Parallelized`: the model, with what a training loop
calls after the weights are loaded, after backward and after the optimizer step.

Nothing here knows about Lightning: the same call serves the strategy, Fabric and plain torch scripts.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_automodel.hf.decoder_layers import (
    multimodal_units,
    named_decoder_layers,
    named_language_layers,
    named_multimodal_units,
)
from lightning_automodel.hf.freezing import freeze
from lightning_automodel.hf.peft import unwrap_peft
from lightning_automodel.parallel.activation_checkpointing import apply_activation_checkpointing
from lightning_automodel.parallel.compile import apply_compile, check_compile
from lightning_automodel.parallel.context_parallel import context_parallel_model
from lightning_automodel.parallel.experts.expert_parallel import (
    apply_expert_parallel,
    expert_precision_problem,
    experts_modules,
)
from lightning_automodel.parallel.experts.unreached_experts import give_every_expert_a_gradient
from lightning_automodel.parallel.float8 import (
    Float8Layers,
    convert_to_float8,
    float8_device_problem,
    float8_layers,
    float8_tp_styles,
)
from lightning_automodel.parallel.fsdp.imageless_ranks import run_tower_on_every_rank
from lightning_automodel.parallel.fsdp.options import FSDPOptions
from lightning_automodel.parallel.fsdp.sharding import ExpertSharding, apply_fsdp
from lightning_automodel.parallel.initial_weights import broadcast_from_rank0, is_meta
from lightning_automodel.parallel.mesh import (
    axis_size,
    expert_fsdp_mesh,
    expert_mesh,
    fsdp_mesh,
    reduction_mesh,
    tp_mesh,
)
from lightning_automodel.parallel.options import ParallelOptions
from lightning_automodel.parallel.parallelized import Parallelized
from lightning_automodel.parallel.pipeline import Pipeline, PipelineOptions, blocks_owner, name_of, pipeline_model
from lightning_automodel.parallel.preflight import PreflightFindings, check_before_collectives
from lightning_automodel.parallel.tensor.apply import TensorParallelPlan, apply_tensor_parallel
from lightning_automodel.parallel.tensor.plans.sequence_parallel import stage_stream_boundaries, stream_placements

Strategy = TypeVar("Strategy", bound="ParallelizationStrategy")


class ParallelizationStrategy(ABC):
    """The whole parallelization flow for a model family; see :func:`register_parallelization_strategy`."""

    @abstractmethod
    def parallelize(self, model: nn.Module, device_mesh: DeviceMesh, options: ParallelOptions) -> nn.Module: ...


_STRATEGIES: dict[str, ParallelizationStrategy] = {}


def register_parallelization_strategy(*class_names: str) -> Callable[[type[Strategy]], type[Strategy]]:
    """Class decorator: parallelize models whose class has one of ``class_names`` with this strategy."""

    def register(cls: type[Strategy]) -> type[Strategy]:
        for name in class_names:
            _STRATEGIES[name] = cls()
        return cls

    return register


def parallelization_strategy_for(model: nn.Module) -> ParallelizationStrategy:
    return _STRATEGIES.get(type(model).__name__, DefaultParallelizationStrategy())


def parallelize(
    model: nn.Module, device_mesh: DeviceMesh, options: ParallelOptions | None = None, **keywords: Any
) -> Parallelized:
    """Parallelize ``model`` in place over the 5D ``device_mesh`` (see :class:`~lightning_automodel.ParallelDims`)
    with the strategy registered for its class, as ``options`` say, or the keywords of :class:`ParallelOptions`
    (FSDP2's flat among them: ``parallelize(model, mesh, sp=True, mp_policy=MixedPrecisionPolicy(...))``).

    Returns the model's :class:`~lightning_automodel.parallel.parallelized.Parallelized`, whose methods a training
    loop calls after the weights are loaded, after backward and after the optimizer step. A PEFT model is
    parallelized through the Hugging Face model it wraps, whose module names the plans know.
    """
    if options is not None and keywords:
        raise TypeError(f"parallelize takes options or their keywords, not both (got {', '.join(keywords)} too).")
    options = options if options is not None else ParallelOptions.from_keywords(**keywords)
    hf_model = unwrap_peft(model)
    freeze(hf_model, *options.freeze)  # before any collective: a target naming nothing is refused on every rank
    parallelization_strategy_for(hf_model).parallelize(hf_model, device_mesh, options)
    return Parallelized(model)


class DefaultParallelizationStrategy(ParallelizationStrategy):
    """The flow every family shares, in the order of the module's docstring."""

    def parallelize(self, model: nn.Module, device_mesh: DeviceMesh, options: ParallelOptions) -> nn.Module:
        """Every check that can refuse runs first, on every rank, before any collective: sizes, the tensor-parallel
        plan and a probe step of the model on the meta device (see :mod:`lightning_automodel.parallel.preflight`).
        A model with real weights is then made identical on every rank (broadcast from global rank 0): tensor
        parallel scatters sharded weights from rank 0, but FSDP shards each rank's own copy, so differently
        initialised replicas would otherwise mix silently. A model on the meta device is left for the caller to
        materialize after this returns.
        """
        on_meta = is_meta(model)
        pipeline = (options.pipeline or PipelineOptions()) if axis_size(device_mesh, "pp") > 1 else None
        findings = _refuse_before_collectives(model, device_mesh, options, pipeline=pipeline)
        float8 = _float8_layers(model, device_mesh, options, findings=findings) if options.float8 else None
        if not on_meta:
            model.to(device_mesh.device_type)
            broadcast_from_rank0(model)
        stages, tensor_parallel = None, findings.planned
        if pipeline is not None:
            stages, tensor_parallel = _split_into_stages(model, device_mesh, pipeline, tensor_parallel=tensor_parallel)
        if axis_size(device_mesh, "cp") > 1:
            context_parallel_model(model, device_mesh, attention=options.cp_attention)
        layers = [layer for name, layer in named_decoder_layers(model) if name not in findings.held_by_root]
        if float8 is not None:
            tensor_parallel = _convert_to_float8(model, device_mesh, options, float8, tensor_parallel=tensor_parallel)
        if tensor_parallel is not None:
            apply_tensor_parallel(model, tp_mesh(device_mesh), tensor_parallel)
        experts = _apply_expert_parallel(model, device_mesh) if axis_size(device_mesh, "ep") > 1 else None
        mode, compiled = options.activation_checkpointing, options.compile_kwargs
        apply_activation_checkpointing(model, layers, mode=mode, compiled=compiled is not None)
        if compiled is not None:
            apply_compile(model, layers, compiled)
        give_every_expert_a_gradient(model)
        _apply_fsdp(model, device_mesh, options.fsdp, stages=stages, experts=experts, findings=findings)
        if multimodal_units(model) and reduction_mesh(device_mesh).size() > 1:
            if stages is not None:
                stages.share_tower(reduction_mesh(device_mesh))
            else:
                run_tower_on_every_rank(model, reduction_mesh(device_mesh))
        return model


def _refuse_before_collectives(
    model: nn.Module, device_mesh: DeviceMesh, options: ParallelOptions, *, pipeline: PipelineOptions | None
) -> PreflightFindings:
    """The checks of :mod:`~lightning_automodel.parallel.preflight`, and those that need the options' mesh sizes."""
    ep = axis_size(device_mesh, "ep")
    check_compile(compile=options.compile, activation_checkpointing=options.activation_checkpointing, ep=ep)
    findings = check_before_collectives(
        model,
        device_mesh,
        pipeline=pipeline,
        sp=options.sp,
        tp_plan=options.tp_plan,
        allow_unsharded_linears=options.allow_unsharded_linears,
        reshard_after_forward=options.fsdp.reshard_after_forward,
        activation_checkpointing=options.activation_checkpointing != "off",
    )
    mp_policy = options.fsdp.mp_policy
    reduce_dtype = (mp_policy.reduce_dtype or mp_policy.param_dtype) if mp_policy else None
    problem = expert_precision_problem(model, reduce_dtype) if ep > 1 else None
    if problem is not None:
        raise ValueError(f"ep={ep} (expert parallel): {problem}.")
    return findings


def _float8_layers(
    model: nn.Module, device_mesh: DeviceMesh, options: ParallelOptions, *, findings: PreflightFindings
) -> Float8Layers:
    """The layers float8 converts (the whole model's, before the pipeline split); refused before any collective
    where the device or the model has none."""
    tp = axis_size(device_mesh, "tp")
    problem = float8_device_problem(options.float8, device_mesh.device_type)
    if problem is None and tp > 1 and options.float8.recipe == "tensorwise" and device_mesh.device_type == "cpu":
        problem = (
            "tensorwise scaling at tp > 1 casts before tensor parallel's collectives, and gloo (CPU) has no float8"
            " collectives: use recipe='rowwise' (float8={'recipe': 'rowwise', 'emulate': True}) on CPUs"
        )
    if problem is not None:
        raise ValueError(f"float8: {problem}.")
    layers = [(name, layer) for name, layer in named_decoder_layers(model) if name not in findings.held_by_root]
    styles = findings.planned.styles if findings.planned is not None else {}
    return float8_layers(model, layers, options.float8, tp_styles=styles, tp=tp)


def _convert_to_float8(
    model: nn.Module,
    device_mesh: DeviceMesh,
    options: ParallelOptions,
    found: Float8Layers,
    *,
    tensor_parallel: TensorParallelPlan | None,
) -> TensorParallelPlan | None:
    """Convert the layers of ``found`` this rank holds; under tensorwise scaling, tensor parallel then takes
    torchao's float8 styles for them (casting before their collectives: with one scale a tensor, the values are those
    of a cast after them)."""
    held = {name for name, _ in model.named_modules()}
    here = Float8Layers([name for name in found.converted if name in held], found.kept)
    # offloaded shards live in CPU memory, where the scales' all-reduce over the GPUs' group cannot reach them
    fsdp_sharded = fsdp_mesh(device_mesh).size() > 1 and options.fsdp.offload_policy is None
    convert_to_float8(model, here, options.float8, fsdp_sharded=fsdp_sharded)
    if tensor_parallel is None or options.float8.recipe != "tensorwise":
        return tensor_parallel
    return dataclasses.replace(tensor_parallel, styles=float8_tp_styles(tensor_parallel.styles, model))


def _split_into_stages(
    model: nn.Module,
    device_mesh: DeviceMesh,
    pipeline: PipelineOptions,
    *,
    tensor_parallel: TensorParallelPlan | None,
) -> tuple[Pipeline, TensorParallelPlan | None]:
    """Keep this rank's stages of ``model``, and the tensor-parallel plan for them: each stage receives the residual
    stream laid out as the plan's layers before it leave it."""
    embedding = name_of(model, model.get_input_embeddings())  # named before the stages drop it
    stages = pipeline_model(model, device_mesh, pipeline)
    if tensor_parallel is None:
        return stages, None
    blocks_list = named_language_layers(model)[0][0].rsplit(".", 1)[0]
    blocks = [[f"{blocks_list}.{index}" for index in layers] for layers in stages.layers.values()]
    styles = stage_stream_boundaries(tensor_parallel.styles, blocks)
    owner = name_of(model, blocks_owner(model)[0])
    stages.receive_stream_as(tp_mesh(device_mesh), stream_placements(styles, embedding, language_model=owner))
    return stages, dataclasses.replace(tensor_parallel, styles=styles)


def _apply_expert_parallel(model: nn.Module, device_mesh: DeviceMesh) -> ExpertSharding:
    """Distribute the experts over ep; FSDP then shards them over what dp_shard x cp leaves."""
    apply_expert_parallel(model, expert_mesh(device_mesh))
    modules = [module for _, module in experts_modules(model)]
    return ExpertSharding(modules, expert_fsdp_mesh(device_mesh), axis_size(device_mesh, "dp_cp"))


def _apply_fsdp(
    model: nn.Module,
    device_mesh: DeviceMesh,
    options: FSDPOptions,
    *,
    stages: Pipeline | None,
    experts: ExpertSharding | None,
    findings: PreflightFindings,
) -> None:
    """FSDP2 over each root: the model, or under pp each stage a rank holds."""
    if stages is not None and options.reshard_after_forward is None:
        # torch's stage keeps a stage's weights gathered from each micro-batch's backward to the last: freeing them
        # after each forward would gather them again for the next micro-batch's forward and backward.
        options = dataclasses.replace(options, reshard_after_forward=False)
    for root in stages.stage_modules() if stages is not None else [model]:
        apply_fsdp(
            root,
            [layer for name, layer in named_decoder_layers(root) if name not in findings.held_by_root],
            fsdp_mesh(device_mesh),
            options,
            experts=experts.within(root) if experts is not None else None,
            parts=[unit for name, unit in named_multimodal_units(root) if name not in findings.held_by_root],
            fp32_compute_module_names=fp32_pinned_names(model),
        )


def fp32_pinned_names(model: nn.Module) -> tuple[str, ...]:
    """Names the model's authors require to stay fp32 even in a bf16 or fp16 model (Hugging Face's
    ``_keep_in_fp32_modules_strict``, which a model gathers from its submodules too)."""
    return tuple(sorted(getattr(model, "_keep_in_fp32_modules_strict", None) or ()))
