"""The checks :func:`~lightning_automodel.parallel.parallelize` runs before its first collective, on every rank.

A model or layout that cannot work is refused here, identically everywhere, before any rank waits in a collective
the others never reach; what they find (the tensor-parallel plan) is what the sharding then applies.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers import PreTrainedModel

from lightning_automodel.hf.decoder_layers import (
    named_decoder_layers,
    named_language_layers,
    named_multimodal_parts,
    named_multimodal_units,
)
from lightning_automodel.hf.denoisers import is_denoiser
from lightning_automodel.hf.vision.image_inputs import builds_images
from lightning_automodel.parallel.context_parallel import check_cp_with_pipeline, context_parallel_problem
from lightning_automodel.parallel.experts.expert_parallel import expert_parallel_problem
from lightning_automodel.parallel.mesh import axis_size, tp_mesh
from lightning_automodel.parallel.options import check_sequence_parallel
from lightning_automodel.parallel.pipeline import PipelineOptions, pipeline_problem, stage_split_problem
from lightning_automodel.parallel.probe.remembered import remembered
from lightning_automodel.parallel.probe.step import (
    ProbeError,
    Trace,
    meta_copy,
    probe,
    refuses_length,
    sequence_lengths,
)
from lightning_automodel.parallel.tensor.apply import TensorParallelPlan, plan_tensor_parallel
from lightning_automodel.parallel.tensor.plans.selection import PlanSpec
from lightning_automodel.parallel.tensor.sizes import validate_tp_sizes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreflightFindings:
    """What the checks before any collective found, for the sharding that follows."""

    planned: TensorParallelPlan | None  # the tensor-parallel plan; None at tp = 1
    # Blocks recomputed outside their calls, or called once an image: no FSDP units of their own.
    held_by_root: tuple[str, ...] = ()


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
) -> PreflightFindings:
    """Every check of :func:`~lightning_automodel.parallel.parallelize` that can refuse, run without a collective:
    sizes, a probe step of the model on the meta device, and at tp > 1 the tensor-parallel plan it then applies.
    :func:`~lightning_automodel.planning.verify.verify_plan` shares it, so that what it verifies is the plan training
    gets."""
    tp = axis_size(device_mesh, "tp")
    check_denoiser_sizes(model, device_mesh)
    check_sequence_parallel(sp=sp, tp=tp)
    if tp > 1:
        validate_tp_sizes(model, tp)
        check_rotary_parameters(model, tp=tp)
    ep = axis_size(device_mesh, "ep")
    problem = expert_parallel_problem(model, ep=ep) if ep > 1 else None
    if problem is not None:
        raise ValueError(f"ep={ep} (expert parallel): {problem}. Use ep=1 for this model.")
    pp, cp = axis_size(device_mesh, "pp"), axis_size(device_mesh, "cp")
    if pp > 1:
        check_pipeline(
            model, pipeline or PipelineOptions(), pp=pp, ep=ep, cp=cp, activation_checkpointing=activation_checkpointing
        )
    if cp > 1:
        check_context_parallel(model, cp=cp, pipeline=pipeline if pp > 1 else None)
    unsharded = probe_unsharded(model, tp=tp)  # at tp = 1 it only adds a check: a model it cannot run goes on
    if sp and isinstance(unsharded, Trace) and unsharded.images_failure:
        raise ValueError(
            f"sp=True (sequence parallel): no probe step of {type(model).__name__} could run its images"
            f" ({unsharded.images_failure}), so where its image features join the sequence-split stream is unchecked"
            " (Qwen3-VL adds them to the first layers' hidden states by a mask over the whole sequence, which a"
            " split stream fails). Use sp=False for this model."
        )
    if tp == 1 and isinstance(unsharded, ProbeError):
        _warn_unprobed(model, unsharded)
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
    held = recomputed + blocks_called_per_image(model, unsharded) if isinstance(unsharded, Trace) else recomputed
    if tp == 1:
        return PreflightFindings(None, held_by_root=held)
    planned = plan_tensor_parallel(
        model,
        tp_mesh(device_mesh),
        sp=sp,
        tp_plan=tp_plan,
        allow_unsharded_linears=allow_unsharded_linears,
        unsharded=unsharded,
    )
    return PreflightFindings(planned, held_by_root=held)


_WARNED_UNPROBED: weakref.WeakSet[type] = weakref.WeakSet()
"""The model classes a warning named as ones the probe cannot run at tp = 1."""


def _warn_unprobed(model: nn.Module, failure: ProbeError) -> None:
    """Once per model class: a plan report parallelizes a model once a pipeline stage and checkpointing mode, and a
    layout search once a candidate, each finding the same."""
    if type(model) in _WARNED_UNPROBED:
        return
    _WARNED_UNPROBED.add(type(model))
    log.warning(
        "A training step of %s on the meta device failed at every sequence length tried (%s): blocks it runs"
        " without autograd and recomputes in backward without calling them (reversible layers), which FSDP2 must"
        " leave to the root's unit, cannot be found. If it has such blocks, its backward will fail on sharded"
        " weights.",
        type(model).__name__,
        failure,
    )


def check_pipeline(
    model: nn.Module,
    pipeline: PipelineOptions,
    *,
    pp: int,
    ep: int,
    cp: int = 1,
    activation_checkpointing: bool = False,
) -> None:
    """At pp > 1: the options suit the model, which splits into stages that compute what it computes whole (see
    :mod:`lightning_automodel.parallel.pipeline`)."""
    pipeline.validate(pp, num_layers=len(named_language_layers(model)))
    if activation_checkpointing and pipeline.splits_backward():
        raise ValueError(
            f"pp_schedule={pipeline.schedule!r} computes the weights' gradients apart from the inputs' (zero bubble),"
            " which recomputes a checkpointed layer twice: torch's checkpoint fails there. Use"
            " pp_schedule='Interleaved1F1B', or activation_checkpointing=False."
        )
    problem = pipeline_problem(model, pp=pp, stages_per_rank=pipeline.stages_per_rank) or stage_split_problem(model)
    if problem is None and cp > 1 and named_multimodal_parts(model):
        problem = (
            f"{type(model).__name__} reads images, which a micro-batch's first stage takes by its rows; with cp={cp}"
            " each rank holds a share of every row, and splitting images with the sequence under pp is not built"
        )
    if problem is not None:
        raise ValueError(f"pp={pp} (pipeline parallel): {problem}. Use pp=1 for this model.")


def check_rotary_parameters(model: nn.Module, *, tp: int) -> None:
    """A rotary embedding that trains parameters (Mistral Large 4's LeRoPE scales its frequencies by a learned
    ``alpha``) computes cos and sin once for every layer's attention, outside any block a plan splits: no style sums
    their gradient over the tp ranks, so each rank's would hold its own part of the attention only. Refused."""
    trained = [
        f"{name}.{parameter}"
        for name, module in model.named_modules()
        if "RotaryEmbedding" in type(module).__name__
        for parameter, value in module.named_parameters(recurse=False)
        if value.requires_grad
    ]
    if trained:
        raise ValueError(
            f"tp={tp} (tensor parallel): {type(model).__name__}'s rotary embedding trains {trained}, whose cos and"
            " sin feed the attention of every layer: no tensor-parallel style sums their gradient over the tp ranks."
            " Freeze them (requires_grad=False), or use tp=1."
        )


def check_denoiser_sizes(model: nn.Module, device_mesh: DeviceMesh) -> None:
    """A diffusers transformer trains over the data-parallel ranks (FSDP2, HSDP) alone so far: its blocks' inputs
    (latents, timestep, text embeddings) are not a token sequence the probe can step, and no plan for tensor, context,
    pipeline or expert parallel is checked for them yet."""
    if not is_denoiser(model):
        return
    sizes = {axis: axis_size(device_mesh, axis) for axis in ("tp", "cp", "pp", "ep")}
    split = ", ".join(f"{axis}={size}" for axis, size in sizes.items() if size > 1)
    if split:
        raise ValueError(
            f"{split}: {type(model).__name__} (a diffusers transformer) trains with dp_shard and dp_replicate (FSDP2,"
            " HSDP) only, with activation checkpointing and compile per block; its tensor, context, pipeline and"
            " expert parallel layouts are not built. Use tp=1, cp=1, pp=1 and ep=1."
        )


def check_context_parallel(model: nn.Module, *, cp: int, pipeline: PipelineOptions | None) -> None:
    """At cp > 1: the model splits its sequences over cp ranks and computes what it computes whole (see
    :mod:`lightning_automodel.parallel.context_parallel`); a pipeline's options compose with the split."""
    check_cp_with_pipeline(cp=cp, pipeline=pipeline)
    problem = context_parallel_problem(model)
    if problem is not None:
        raise ValueError(f"cp={cp} (context parallel): {problem}. Use cp=1 for this model.")


def probe_unsharded(model: nn.Module, *, tp: int) -> Trace | ProbeError | None:
    """One step of a meta-device copy of the Hugging Face ``model`` (see :mod:`lightning_automodel.parallel.probe`),
    or how it failed at every sequence length tried. A vision-language model's step carries images
    (:mod:`lightning_automodel.hf.vision.image_inputs`); where that fails, a text-only step stands in (its trace says
    how the step with images failed). Models that are not Hugging Face ones, whose inputs are unknown, are not probed
    (None)."""
    if not isinstance(model, PreTrainedModel):
        return None
    return remembered(model, how=("unsharded", tp), probe=lambda: _probe_with_images_first(model, tp=tp))


def _probe_with_images_first(model: nn.Module, *, tp: int) -> Trace | ProbeError:
    with_images = _probe_at_lengths(model, tp=tp, images=True) if builds_images(model) else None
    if isinstance(with_images, Trace):
        return with_images
    found = _probe_at_lengths(model, tp=tp, images=False)
    if isinstance(found, Trace) and with_images is not None:
        found.images_failure = str(with_images)
    return found


def _probe_at_lengths(model: nn.Module, *, tp: int, images: bool) -> Trace | ProbeError:
    failure = None
    for tokens in sequence_lengths(model, tp=tp, images=images):
        try:
            return probe(meta_copy(model), tokens=tokens, images=images)
        except ProbeError as error:
            failure = failure or error
            if not refuses_length(error):
                break
    log.debug("The meta-device probe of %s (images: %s) failed: %s", type(model).__name__, images, failure)
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


def blocks_called_per_image(model: nn.Module, unsharded: Trace) -> tuple[str, ...]:
    """The blocks and units of the parts beside the language model that the probe's step with images (an image a
    row) calls more than once: once an image (MiniCPM-V's merger) or once a view (DeepSeek-OCR 2's tower, on global
    views, then on crops). As units of their own, FSDP2 would gather them once a call, and ranks holding other
    numbers of images or views (a stand-in's one) would issue other collectives. The root's unit holds them,
    gathered once a step."""
    parts = tuple(f"{name}." for name, _ in named_multimodal_parts(model))
    if not unsharded.images or not parts:
        return ()
    blocks = [name for name, _ in named_decoder_layers(model) if name.startswith(parts)]
    units = [name for name, _ in named_multimodal_units(model)]
    return tuple(name for name in [*blocks, *units] if len(unsharded.calls.get(name, ())) > 1)
