"""Checks run on every rank for test_memory.py: the memory a real training step takes on CPU, read from the process's
resident set, to hold the fake-tensor estimate of planning/memory/activations.py against."""

from __future__ import annotations

import ctypes
from functools import partial

import torch

from lightning_automodel import ParallelDims
from lightning_automodel.parallel.parallelizer import parallelize
from lightning_automodel.parallel.pipeline import pipeline_of
from lightning_automodel.planning.memory.activations import gradient_bytes, training_step
from lightning_automodel.testing.models import tiny_model

# Large enough that activations dwarf what Python and gloo allocate on the side (a few MiB).
MEMORY_MODEL = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=1024,
)
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def measured_activation_bytes(
    dims: ParallelDims, micro_batch: int, seq_len: int, *, loss_chunks: int = 1, **options
) -> int:
    """The resident memory one training step adds on this rank at its peak, above the parameters and gradients it
    held before (a step ran first, so nothing is allocated for the first time).

    Under pp the step starts without gradients, as after Lightning's ``zero_grad``, and the gradients it makes are
    left out; what the stages' first step allocated for good (the buffers torch's stages receive activations and
    gradients into) is counted in.

    CPU tensors come from malloc: glibc is told to map every allocation above 64 KiB on its own and unmap it when
    freed, so the resident set rises and falls with the live tensors, and its high-water mark (reset through
    /proc/self/clear_refs) is the step's peak."""
    map_each_large_allocation()
    model = tiny_model(vocab_size=8000, **MEMORY_MODEL)
    mesh = dims.resolve(torch.distributed.get_world_size()).build_mesh("cpu")
    parallelize(model, mesh, **options)
    input_ids = torch.randint(8000, (micro_batch, seq_len), generator=torch.Generator().manual_seed(0))
    training_step(model, input_ids=input_ids, mesh=mesh, loss_chunks=loss_chunks)
    pipeline = pipeline_of(model)
    if pipeline is not None:
        model.zero_grad(set_to_none=True)
    peak = resident_peak_above_held(
        partial(training_step, model, input_ids=input_ids, mesh=mesh, loss_chunks=loss_chunks)
    )
    if pipeline is None:
        return peak
    return peak - gradient_bytes(model) + _receive_buffer_bytes(pipeline)


def resident_peak_above_held(run) -> int:
    """The resident memory one call of ``run`` adds at its peak above the resident set it began with (see
    :func:`measured_activation_bytes`)."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the high-water mark starts again from the resident set now
    held = _resident()["VmRSS"]
    run()
    return _resident()["VmHWM"] - held


def map_each_large_allocation() -> None:
    """glibc maps every allocation above 64 KiB on its own, and unmaps it when freed (see
    :func:`measured_activation_bytes`). Called before whatever in the process allocates: a Trainer run under glibc's
    defaults leaves freed memory resident that later allocations reuse unseen (a step measured 17% low)."""
    ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 64 * 1024)


def _receive_buffer_bytes(pipeline) -> int:
    """The buffers torch's stages receive each micro-batch's activations and gradients into, from their first step
    on (their ``_RecvInfo``s)."""
    infos = [
        info
        for stage in pipeline.torch_stages()
        for received in (*stage.args_recv_info.values(), *stage.grad_recv_info.values())
        for info in received
    ]
    return sum(info.buffer.untyped_storage().nbytes() for info in infos if info.buffer is not None)


def _resident() -> dict[str, int]:
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return {name: int(fields[name].split()[0]) * 1024 for name in ("VmRSS", "VmHWM")}
