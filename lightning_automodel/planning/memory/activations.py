"""Activation memory per rank, estimated by running one training step of the parallelized model on fake tensors.

The model is parallelized for real in a fake process group (as for the plan report), its weights made fake CPU
tensors (shapes and dtypes, no data), as are the buffers the step makes empty (FSDP2's gathered layers), and one
forward and backward of a micro-batch runs through the code training runs: tensor parallel, sequence parallel,
FSDP2's gathers, activation checkpointing and its recomputation, context parallel's split, expert parallel's
dispatch, the loss (a vision-language model's rows hold images, whose pixels the step runs through the vision tower:
:mod:`.step_images`; a mixture-of-experts model's tokens go where an assumed routing sends them: :mod:`.routing`).
torch's ``MemTracker`` follows every tensor the step allocates and frees; the estimate is its peak above what the
rank held before the step (parameters, and gradients already allocated: a step after the first, or an upper bound for
a first whose gradients appear as it goes). Nothing is re-derived by hand, so the estimate cannot drift from the
code, and an 8B model at a long sequence is counted in seconds, in under half a GiB of host memory.

Fake CPU tensors, not the meta device: the attention kernel is chosen by device, and on meta tensors SDPA falls back
to its math path, which keeps the [heads, S, S] scores a fused kernel (CPU's flash attention, as on a GPU) never
holds; attention dropout is counted as a GPU's fused kernel holds it (:mod:`.attention_kernel`). Under context
parallel the kernel is therefore SDPA over a dense [rows, S/cp, S] mask, which flex attention's block mask (the GPU's
default) does not hold: the estimate counts it.

Under pipeline parallel the step is the rank's own part of torch's schedule, run for real: its stages' forwards and
backwards of every micro-batch in the schedule's order, the activations of the micro-batches in flight (1F1B: as many
as stages from this one on; GPipe: all), the buffers each stage receives activations and gradients into, FSDP2's
gradients kept unsharded until the last micro-batch. The stages are told their shapes
(:meth:`~lightning_automodel.parallel.pipeline.Pipeline.tell_shapes`), which they otherwise exchange at their first step
as pickled objects, which a fake process group cannot carry; and the fake process group's sends keep their tensors
until their work is dropped, as gloo's and NCCL's do (:func:`~lightning_automodel.planning.simulation.fake_world`).
The step starts without gradients (as after Lightning's ``zero_grad``), and those it makes are left out.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import Counter
from collections.abc import Iterator
from functools import partial

import torch
from torch import nn
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed._tools.mod_tracker import ModTracker
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_automodel.hf.decoder_layers import named_decoder_layers
from lightning_automodel.hf.ties import to_empty_tied
from lightning_automodel.parallel.chunked_loss import SPLIT_CALLS, chunked_causal_lm_loss_sum, chunking_problem
from lightning_automodel.parallel.context_parallel import context_parallel_of
from lightning_automodel.parallel.loss import causal_lm_loss_sum, global_token_mean
from lightning_automodel.parallel.mesh import ParallelDims, axis_size
from lightning_automodel.parallel.parallelizer import parallelize
from lightning_automodel.parallel.pipeline import pipeline_of
from lightning_automodel.planning.memory.attention_kernel import fused_attention
from lightning_automodel.planning.memory.fake_kernels import GroupedMatmulOfAnyDtype
from lightning_automodel.planning.memory.layer_extrapolation import FEW_LAYERS, over_layers
from lightning_automodel.planning.memory.pipeline_extrapolation import over_stage_layers
from lightning_automodel.planning.memory.routing import ExpertRouting, routed
from lightning_automodel.planning.memory.step_images import StepImages, step_images
from lightning_automodel.planning.simulation import fake_world

_CPU = torch.device("cpu")
_VALUE_DEPENDENT = (DynamicOutputShapeException, DataDependentOutputException)


class _ModulesUntracked(ModTracker):
    """A module tracker that tracks nothing: entering it installs no hooks."""

    def __enter__(self) -> _ModulesUntracked:
        return self

    def __exit__(self, *args) -> None: ...


class TotalsTracker(MemTracker):
    """torch's MemTracker, its totals alone: every live tensor storage, counted once, FSDP2's freed and regrown
    unsharded weights as they are. It follows no module: its statistics by module refuse a module called twice at the
    top of one step (a chunked loss calls lm_head once a chunk, ours and torchtitan's) and a module called inside
    another's call (a pipelined model's schedule runs the stage's own forward). The totals come from its dispatch mode
    and storage hooks alone."""

    def __init__(self) -> None:
        super().__init__()
        self._mod_tracker = _ModulesUntracked()


_EMPTY = (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default)
# Empty tensors under this size stay real: bookkeeping a collective fills and the code reads back (expert parallel's
# token counts), where FSDP2's buffers and a stage's receive buffers are whole layers and activations.
_SMALL_BYTES = 64 * 1024


class _EmptyTensorsFake(TorchDispatchMode):
    """Large tensors made empty made fake: FSDP2's gather and reduce-scatter buffers, its unsharded layers, a stage's
    receive buffers, which the step only fills from fake tensors, then cost neither host memory nor the time of filling
    them (three quarters of a step of whole layers, before). Other tensors made from nothing stay real, for the code
    that reads them (the mesh's ranks; the positions from which transformers decides to skip the causal mask, as it
    does in training). ``fake_mode`` is entered for the op alone: left active, it would be the one DTensor's shape
    propagation runs in, and the tracker would count the global-shape tensors made there."""

    def __init__(self, fake_mode: FakeTensorMode) -> None:
        super().__init__()
        self.fake_mode = fake_mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _EMPTY or active_fake_mode() is not None or not _large_on_cpu(args[0], **kwargs):
            return func(*args, **kwargs)
        with self.fake_mode:
            return func(*args, **kwargs)


def _large_on_cpu(size, *, dtype: torch.dtype | None = None, device: torch.device | None = None, **_) -> bool:
    dtype = dtype or torch.get_default_dtype()
    return torch.device(device or "cpu").type == "cpu" and math.prod(size) * dtype.itemsize >= _SMALL_BYTES


def activation_bytes(
    model: nn.Module,
    dims: ParallelDims,
    *,
    micro_batch: int,
    seq_len: int,
    rank: int = 0,
    loss_chunks: int = 1,
    images_per_row: int | None = None,
    image_tokens: int | None = None,
    **options,
) -> int:
    """The bytes a training step of ``micro_batch`` rows of ``seq_len`` tokens allocates on ``rank`` at its peak,
    above its parameters and gradients: saved activations, the working memory of the layer being computed or
    recomputed, gathered FSDP2 layers, the logits and the loss.

    ``model`` is on the meta device and is consumed here (pass a copy to keep it); ``loss_chunks``: CausalLMModule's
    (see :mod:`~lightning_automodel.parallel.chunked_loss`); a vision-language model's rows hold ``images_per_row``
    images of ``image_tokens`` tokens (:func:`.step_images.step_images`: by default one
    a row), whose pixels the step runs through the vision tower; a mixture-of-experts model's tokens go to the experts
    of an assumed routing, balanced unless ``expert_imbalance`` (the busiest expert's share relative to a balanced
    one, :class:`~lightning_automodel.planning.memory.routing.ExpertRouting`) says otherwise; ``options`` are
    :func:`~lightning_automodel.parallel.parallelizer.parallelize`'s (``cp_attention`` is SDPA's: see the module's
    docstring). Must run outside any process group.

    Under pp (``options["pipeline"]``, default :class:`~lightning_automodel.parallel.pipeline.PipelineOptions`),
    ``micro_batch`` rows are split into the schedule's micro-batches, ``rank`` holds its stages only, the step starts
    without gradients and the gradients it makes are left out (the buffers torch's stages receive into, which a first
    step allocates for good, are counted).

    A model of many alike decoder layers is stepped with a few of them (under pp, and a few micro-batches) and the
    peak extrapolated (:mod:`.layer_extrapolation`, :mod:`.pipeline_extrapolation`).
    """
    if loss_chunks > 1:  # refused as CausalLMModule refuses it, before any step (its check runs a model of its own)
        problem = SPLIT_CALLS if dims.cp > 1 or dims.pp > 1 else chunking_problem(model)
        if problem is not None:
            raise ValueError(f"loss_chunks={loss_chunks}: {problem}.")
    images = step_images(model, images_per_row=images_per_row, image_tokens=image_tokens)
    if images is not None:
        images.check_fits(seq_len)
        images.check_layout(loss_chunks=loss_chunks)
    shape = dict(micro_batch=micro_batch, seq_len=seq_len, loss_chunks=loss_chunks, images=images)
    step = partial(_step_peak, dims=dims, rank=rank, **shape, **options)
    # layers within FSDP2's prefetch window each add a gathered layer too: the few measured lie beyond it
    window = max(options.get("forward_prefetch", 0), options.get("backward_prefetch", 1))
    few = tuple(count + max(0, window - 1) for count in FEW_LAYERS)
    if dims.pp > 1:
        pipeline = options.get("pipeline")
        return over_stage_layers(step, model, dims=dims, rank=rank, pipeline=pipeline, micro_batch=micro_batch, few=few)
    return over_layers(step, model, few=few)


def _step_peak(
    model: nn.Module,
    *,
    dims: ParallelDims,
    micro_batch: int,
    seq_len: int,
    rank: int,
    loss_chunks: int = 1,
    images: StepImages | None = None,
    expert_imbalance: float = 1.0,
    **options,
) -> int:
    """The peak of one step of ``model`` as it is (see :func:`activation_bytes`)."""
    inputs = images.inputs(model, rows=micro_batch, tokens=seq_len) if images is not None else {}
    name = f"{type(model).__name__} ({getattr(model.config, 'model_type', 'no model_type')})"  # before FSDP2's class
    with fake_world(dims.world_size, rank=rank, estimate=True):
        mesh = dims.build_mesh("cpu")
        parallelize(model, mesh, **{**options, "cp_attention": "sdpa"})
        pipeline = pipeline_of(model)
        with FakeTensorMode(allow_non_fake_inputs=True) as fake_mode:
            to_empty_tied(model, device=_CPU)
            if pipeline is None:  # a pipeline's schedule computes gradients apart from those held (see below)
                for parameter in model.parameters():
                    if parameter.requires_grad:
                        parameter.grad = torch.zeros_like(parameter)
            input_ids = inputs.pop("input_ids", None)
            if input_ids is None:
                input_ids = torch.zeros(micro_batch, seq_len, dtype=torch.long)
            if "pixel_values" in inputs:  # shapes alone, a fake CPU tensor
                inputs["pixel_values"] = torch.empty(inputs["pixel_values"].shape)
        if pipeline is not None:
            context = context_parallel_of(model)  # a pipeline under cp receives a rank's share of the rows
            pipeline.adopt_view_weights()
            pipeline.tell_shapes(
                batch_shape=(micro_batch, seq_len if context is None else context.padded_length(seq_len) // dims.cp),
                hidden_size=model.config.get_text_config().hidden_size,
                dtype=_stream_dtype(model, options.get("mp_policy")),
            )
        # The step runs on the fake tensors with their mode left: DTensor then propagates shapes in a fake mode of its
        # own, whose global-shape tensors the tracker leaves out (in the step's mode it would count them as memory).
        try:
            with (
                GroupedMatmulOfAnyDtype(),
                _EmptyTensorsFake(fake_mode),
                fused_attention(),
                routed(model, ExpertRouting(expert_imbalance)),
                _refused_if_untraceable(name),
                TotalsTracker() as tracker,
            ):
                tracker.track_external(model)
                held = tracker.get_tracker_snapshot()[_CPU]["Total"]
                training_step(model, input_ids=input_ids, mesh=mesh, loss_chunks=loss_chunks, images=inputs)
                peak = tracker.get_tracker_snapshot("peak")[_CPU]["Total"]
        finally:
            fake_mode.cache_clear()  # its dispatch cache is the class's, and would keep this model's entries
        # Under pp the step starts without gradients (as after Lightning's zero_grad) and makes them: they are not
        # activations. Without pp they were held all along.
        gradients = gradient_bytes(model) if pipeline is not None else 0
    return peak - held - gradients


class UntraceableStep(ValueError):
    """The estimate cannot run a model's training step on fake tensors: a refusal, as a layout's (a ValueError)."""


@contextlib.contextmanager
def _refused_if_untraceable(name: str) -> Iterator[None]:
    """A step that fails on fake tensors refused, naming the model (``name``) and why, in place of the fake kernel's
    error (which torch's fake mode also logs, with its traceback: not while inside)."""
    fake_log = logging.getLogger(FakeTensorMode.__module__)
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        yield
    except (RuntimeError, NotImplementedError) as error:
        if isinstance(error, _VALUE_DEPENDENT):
            why = f"an operation ({error}) whose output's size depends on values, which fake tensors do not hold"
        else:
            why = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        raise UntraceableStep(
            f"{name}: the memory estimate cannot run its training step on fake tensors (shapes without values):"
            f" {why.rstrip('.')}. Measure a real step's peak instead (a few steps on one GPU,"
            " torch.cuda.max_memory_allocated)."
        ) from error
    finally:
        fake_log.setLevel(level)


def gradient_bytes(model: nn.Module) -> int:
    """The bytes of the gradients ``model``'s parameters hold on this rank (their local shards)."""
    grads = [parameter.grad for parameter in model.parameters() if parameter.grad is not None]
    shards = [grad.to_local() if isinstance(grad, DTensor) else grad for grad in grads]
    storages = {StorageWeakRef(shard.untyped_storage()): shard.untyped_storage() for shard in shards}
    return sum(storage.nbytes() for storage in storages.values())  # FSDP2's of one unit share one


def _stream_dtype(model: nn.Module, mp_policy: MixedPrecisionPolicy | None) -> torch.dtype:
    """The dtype of the hidden states pipeline stages hand each other: what FSDP2 casts a stage's output to, else
    what its layers compute in (the policy's, else that of most of a decoder layer's weights)."""
    if mp_policy is not None and (mp_policy.output_dtype or mp_policy.param_dtype) is not None:
        return mp_policy.output_dtype or mp_policy.param_dtype
    _, layer = named_decoder_layers(model)[0]
    weights = Counter()
    for parameter in layer.parameters():
        weights[parameter.dtype] += parameter.numel() if parameter.is_floating_point() else 0
    return weights.most_common(1)[0][0]


def training_step(
    model: nn.Module,
    *,
    input_ids: torch.Tensor,
    mesh: DeviceMesh,
    loss_chunks: int = 1,
    images: dict[str, torch.Tensor] | None = None,
) -> None:
    """Forward and backward of the loss CausalLMModule trains on (its ``_step``, without its accuracy metric): under
    cp and pp the model's own, which splits the batch in its call (pp runs its schedule there); otherwise the token
    mean over the data-parallel ranks, from the logits (vocabulary-sharded under tp, hence ``loss_parallel``),
    ``loss_chunks`` sequence chunks at a time where more than one. ``images``: a vision-language model's image inputs
    (``pixel_values``, ...), passed with the token ids. Also what the tests measure real steps with."""
    images = images or {}
    with loss_parallel() if axis_size(mesh, "tp") > 1 else contextlib.nullcontext():
        if loss_chunks > 1:
            loss_sum, tokens, _ = chunked_causal_lm_loss_sum(
                model, input_ids=input_ids, labels=input_ids, chunks=loss_chunks
            )
            loss = global_token_mean(loss_sum, tokens, mesh)
        elif context_parallel_of(model) is not None or pipeline_of(model) is not None:
            loss = model(input_ids=input_ids, labels=input_ids, **images).loss
        else:
            loss_sum, tokens = causal_lm_loss_sum(model(input_ids=input_ids, **images).logits, input_ids)
            loss = global_token_mean(loss_sum, tokens, mesh)
        loss.backward()
