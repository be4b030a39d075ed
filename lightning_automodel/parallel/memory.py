"""Activation memory per rank, estimated by running one training step of the parallelized model on fake tensors.

The model is parallelized for real in a fake process group (as for the plan report), its weights made fake CPU
tensors (shapes and dtypes, no data), and one forward and backward of a micro-batch runs through the code training
runs: tensor parallel, sequence parallel, FSDP2's gathers, activation checkpointing and its recomputation, context
parallel's split, the loss. torch's ``MemTracker`` follows every tensor the step allocates and frees; the estimate
is its peak above what the rank held before the step (parameters, and gradients already allocated: a step after
the first, or an upper bound for a first whose gradients appear as it goes). Nothing is re-derived by hand, so the
estimate cannot drift from the code, and an 8B model at a long sequence is counted in seconds.

Fake CPU tensors, not the meta device: the attention kernel is chosen by device, and on meta tensors SDPA falls back
to its math path, which keeps the [heads, S, S] scores a fused kernel (CPU's flash attention, as on a GPU) never
holds. Under context parallel the kernel is therefore SDPA over a dense [rows, S/cp, S] mask, which flex attention's
block mask (the GPU's default) does not hold: the estimate counts it.

Not under pipeline parallel: torch's pipeline stages exchange their shapes as pickled objects at their first step,
which a fake process group cannot carry.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel

from lightning_automodel.mesh import ParallelDims, axis_size
from lightning_automodel.parallel.chunked_loss import SPLIT_CALLS, chunked_causal_lm_loss_sum, chunking_problem
from lightning_automodel.parallel.context_parallel import context_parallel_of
from lightning_automodel.parallel.layer_extrapolation import FEW_LAYERS, over_layers
from lightning_automodel.parallel.loss import causal_lm_loss_sum, global_token_mean
from lightning_automodel.parallel.parallelizer import parallelize
from lightning_automodel.parallel.simulation import fake_world
from lightning_automodel.parallel.tensor_parallel import to_empty_tied

_CPU = torch.device("cpu")


class TotalsTracker(MemTracker):
    """torch's MemTracker, its totals alone: every live tensor storage, counted once, FSDP2's freed and regrown
    unsharded weights as they are. Its statistics by module are off: they refuse a module called twice at the top of
    one step, as a chunked loss calls lm_head (ours once a chunk, torchtitan's too). The totals come from its dispatch
    mode and storage hooks alone."""

    def _pre_fw_hook(self, *args) -> None: ...
    def _post_fw_hook(self, *args) -> None: ...
    def _pre_bw_hook(self, *args) -> None: ...
    def _post_bw_hook(self, *args) -> None: ...


def activation_bytes(
    model: nn.Module,
    dims: ParallelDims,
    *,
    micro_batch: int,
    seq_len: int,
    rank: int = 0,
    loss_chunks: int = 1,
    **options,
) -> int:
    """The bytes a training step of ``micro_batch`` rows of ``seq_len`` tokens allocates on ``rank`` at its peak,
    above its parameters and gradients: saved activations, the working memory of the layer being computed or
    recomputed, gathered FSDP2 layers, the logits and the loss.

    ``model`` is on the meta device and is consumed here (pass a copy to keep it); ``loss_chunks``: CausalLMModule's
    (see :mod:`~lightning_automodel.parallel.chunked_loss`); ``options`` are
    :func:`~lightning_automodel.parallel.parallelizer.parallelize`'s (``cp_attention`` is SDPA's: see the module's
    docstring). Must run outside any process group.

    A model of many alike decoder layers is stepped with a few of them and the peak extrapolated (see
    :mod:`~lightning_automodel.parallel.layer_extrapolation`).
    """
    if dims.pp > 1:
        raise ValueError(
            f"activation_bytes does not estimate pipeline parallel (pp={dims.pp}) yet: torch's pipeline stages exchange"
            " their shapes as pickled objects, which a fake process group cannot carry. Estimate at pp=1."
        )
    if loss_chunks > 1:  # refused as CausalLMModule refuses it, before any step (its check runs a model of its own)
        problem = SPLIT_CALLS if dims.cp > 1 else chunking_problem(model)
        if problem is not None:
            raise ValueError(f"loss_chunks={loss_chunks}: {problem}.")
    shape = dict(micro_batch=micro_batch, seq_len=seq_len, loss_chunks=loss_chunks)
    step = partial(_step_peak, dims=dims, rank=rank, **shape, **options)
    # layers within FSDP2's prefetch window each add a gathered layer too: the few measured lie beyond it
    window = max(options.get("forward_prefetch", 0), options.get("backward_prefetch", 1))
    return over_layers(step, model, few=tuple(count + max(0, window - 1) for count in FEW_LAYERS))


def _step_peak(
    model: nn.Module, *, dims: ParallelDims, micro_batch: int, seq_len: int, rank: int, loss_chunks: int = 1, **options
) -> int:
    """The peak of one step of ``model`` as it is (see :func:`activation_bytes`)."""
    with fake_world(dims.world_size, rank=rank):
        mesh = dims.build_mesh("cpu")
        parallelize(model, mesh, **{**options, "cp_attention": "sdpa"})
        with FakeTensorMode(allow_non_fake_inputs=True) as fake_mode:
            to_empty_tied(model, device=_CPU)
            for parameter in model.parameters():
                if parameter.requires_grad:
                    parameter.grad = torch.zeros_like(parameter)
            input_ids = torch.zeros(micro_batch, seq_len, dtype=torch.long)
        # The step runs on the fake tensors with their mode left: DTensor then propagates shapes in a fake mode of its
        # own, whose global-shape tensors the tracker leaves out (in the step's mode it would count them as memory).
        try:
            with TotalsTracker() as tracker:
                tracker.track_external(model)
                held = tracker.get_tracker_snapshot()[_CPU]["Total"]
                training_step(model, input_ids=input_ids, mesh=mesh, loss_chunks=loss_chunks)
                peak = tracker.get_tracker_snapshot("peak")[_CPU]["Total"]
        finally:
            fake_mode.cache_clear()  # its dispatch cache is the class's, and would keep this model's entries
    return peak - held


def training_step(model: nn.Module, *, input_ids: torch.Tensor, mesh: DeviceMesh, loss_chunks: int = 1) -> None:
    """Forward and backward of the loss CausalLMModule trains on (its ``_step``, without its accuracy metric): under
    cp the model's own, which splits the batch in its call; otherwise the token mean over the data-parallel ranks,
    from the logits (vocabulary-sharded under tp, hence ``loss_parallel``), ``loss_chunks`` sequence chunks at a time
    where more than one. Also what the tests measure real steps with."""
    with loss_parallel() if axis_size(mesh, "tp") > 1 else contextlib.nullcontext():
        if loss_chunks > 1:
            loss_sum, tokens, _ = chunked_causal_lm_loss_sum(
                model, input_ids=input_ids, labels=input_ids, chunks=loss_chunks
            )
            loss = global_token_mean(loss_sum, tokens, mesh)
        elif context_parallel_of(model) is not None:
            loss = model(input_ids=input_ids, labels=input_ids).loss
        else:
            loss_sum, tokens = causal_lm_loss_sum(model(input_ids=input_ids).logits, input_ids)
            loss = global_token_mean(loss_sum, tokens, mesh)
        loss.backward()
