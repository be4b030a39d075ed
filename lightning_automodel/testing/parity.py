"""Parallel against one process: a model's loss, logits and every gradient (as full tensors) against a single-process
run of the same model on the whole batch, each data-parallel rank feeding its slice, and the tolerances they must
meet. Errors are relative to the largest reference magnitude of each tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from lightning_automodel import ParallelDims
from lightning_automodel.parallel.full_tensor import full_tensor
from lightning_automodel.planning.replica_comparison import FP32_TOLERANCE  # verify_plan's, the tests' too
from lightning_automodel.planning.replica_comparison import loss_and_logits as loss_of  # verify_plan's loss too
from lightning_automodel.testing.models import batch

# fp32: TP and FSDP change only the order of reductions; measured errors are ~1e-6 (see the closing notes).

STEPS = 3
LR = 1e-2
# AdamW scales every element's step to about lr whatever the gradient's size, so reduction-order noise on a
# near-zero gradient element can move it by a fraction of lr: measured up to 6.3e-4 (Qwen3 classifier) after
# 3 steps of lr 1e-2. A gradient of the wrong direction moves weights by O(lr x steps) = 3e-2; one of the
# wrong scale barely moves them, which is why the gradients are compared at every step too.
WEIGHT_TOLERANCE = 2e-3
# The first loss and gradients are exact up to reduction order (FP32_TOLERANCE); later ones inherit the
# weights' AdamW noise (gradients measured up to 2e-3 relative). A gradient of the wrong scale is off by
# O(1) at every step, the first included.
TRAINED_LOSS_TOLERANCE = 1e-4
TRAINED_GRAD_TOLERANCE = 1e-2

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


full = full_tensor


def relative_error(actual: torch.Tensor, expected: torch.Tensor, *, floor: float = 1e-12) -> float:
    """Largest difference relative to the largest expected value, or to ``floor`` if that is smaller."""
    actual, expected = full(actual).float(), full(expected).float()
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(floor)).item()


def dims_for(world_size: int, tp: int, dp_replicate: int = 1, ep: int = 1) -> ParallelDims:
    return ParallelDims(tp=tp, dp_replicate=dp_replicate, ep=ep).resolve(world_size)


@dataclass
class Outputs:
    """What one forward and backward pass produced: the loss, the logits and every gradient, as full tensors."""

    loss: torch.Tensor
    logits: torch.Tensor
    grads: dict[str, torch.Tensor]


def single_process_outputs(reference: torch.nn.Module, *, batch_size: int = 4) -> Outputs:
    """The reference's loss, logits and gradients on the whole batch (gradients accumulate over calls)."""
    tokens, labels = batch(batch_size)
    loss, logits = loss_of(reference, tokens, labels)
    loss.backward()
    return Outputs(loss, logits, {name: p.grad for name, p in reference.named_parameters() if p.grad is not None})


def parallel_outputs(
    model: torch.nn.Module, dp: DeviceMesh | None, *, batch_size: int = 4, placed: bool = True
) -> Outputs:
    """This rank's logits (of its slice of the batch), the loss averaged over ``dp`` and every gradient, gathered.

    ``dp`` is the data-parallel mesh: each of its ranks gets a contiguous slice of the batch. None: no split.
    ``placed``: the gradients must be in their parameters' placements (as FSDP2 hands them; not so for a model
    parallelized by torch's ``parallelize_module`` alone).
    """
    tokens, labels = batch(batch_size)
    rank_slice = dp_slice(dp, batch_size)
    with loss_parallel():
        loss, logits = loss_of(model, tokens[rank_slice], labels[rank_slice])
        loss.backward()
    loss = full(loss).detach().clone()
    if dp is not None:
        dist.all_reduce(loss, group=dp.get_group())
        loss /= dp.size()
    if placed:
        assert_gradients_placed_as_parameters(model)
    grads = {name: full(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    return Outputs(loss, full(logits), grads)


def assert_gradients_placed_as_parameters(model: torch.nn.Module) -> None:
    """What an optimizer and clipping read: each gradient in its parameter's placements, not a ``Partial`` sum a
    later op would complete (``full`` would hide one)."""
    misplaced = {
        name: (p.grad.placements, p.placements)
        for name, p in model.named_parameters()
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements
    }
    assert not misplaced, misplaced


def dp_slice(dp: DeviceMesh | None, batch_size: int) -> slice:
    """The rows of the batch this data-parallel rank reads."""
    dp_rank, dp_size = (dp.get_local_rank(), dp.size()) if dp is not None else (0, 1)
    return slice(dp_rank * batch_size // dp_size, (dp_rank + 1) * batch_size // dp_size)


def gradient_errors(outputs: Outputs, expected: Outputs, *, floor: float = 0.0) -> dict[str, float]:
    """Relative error of every parameter's gradient; the same parameters must get one.

    ``floor``: a share of the largest gradient of the model below which a gradient counts as zero. A gradient that
    is zero in exact arithmetic (a key bias before a softmax without rotary embeddings) holds rounding noise only,
    which relative to itself is of order 1 whatever the layout.
    """
    assert outputs.grads.keys() == expected.grads.keys(), (
        f"gradients differ in which parameters get one: {sorted(outputs.grads.keys() ^ expected.grads.keys())}"
    )
    smallest = floor * max((g.abs().max().item() for g in expected.grads.values()), default=0.0)
    return {
        name: relative_error(grad, expected.grads[name], floor=max(smallest, 1e-12))
        for name, grad in outputs.grads.items()
    }


def output_errors(outputs: Outputs, expected: Outputs, rank_slice: slice) -> dict[str, float]:
    """Max relative errors of the loss, this rank's logits and every gradient."""
    return {
        "loss": relative_error(outputs.loss, expected.loss),
        "logits": relative_error(outputs.logits, expected.logits[rank_slice]),
        "grad": max(gradient_errors(outputs, expected).values()),
    }


def forward_backward_errors(
    model, reference, dp: DeviceMesh | None, *, batch_size: int = 4, placed: bool = True
) -> dict[str, float]:
    """Max relative errors of the dp-averaged loss, this rank's logits and every gradient against ``reference``,
    which runs the whole batch."""
    expected = single_process_outputs(reference, batch_size=batch_size)
    outputs = parallel_outputs(model, dp, batch_size=batch_size, placed=placed)
    return output_errors(outputs, expected, dp_slice(dp, batch_size))


def weight_error(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    """Largest absolute difference of any weight (AdamW steps are of size lr, whatever the weight's scale)."""
    ref_params = dict(reference.named_parameters())
    return max((full(p) - ref_params[name]).abs().max().item() for name, p in model.named_parameters())


def check_training(model, reference, dp: DeviceMesh | None, *, steps: int = STEPS) -> dict[str, float]:
    """AdamW steps on both models: every step's loss, logits and gradients, then the weights."""
    optimizers = [torch.optim.AdamW(m.parameters(), lr=LR) for m in (model, reference)]
    per_step = []
    for _ in range(steps):
        per_step.append(forward_backward_errors(model, reference, dp))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    first, later = per_step[0], {key: max(step[key] for step in per_step[1:]) for key in per_step[0]}
    result = {**{f"first_{k}": v for k, v in first.items()}, **{f"later_{k}": v for k, v in later.items()}}
    result[f"weights_after_{steps}_steps"] = weight_error(model, reference)
    assert max(first.values()) < FP32_TOLERANCE, result
    assert later["loss"] < TRAINED_LOSS_TOLERANCE and max(later.values()) < TRAINED_GRAD_TOLERANCE, result
    assert result[f"weights_after_{steps}_steps"] < WEIGHT_TOLERANCE, result
    return result


def within_bf16_noise(errors: dict[str, float], noise: dict[str, float]) -> dict[str, float]:
    """Errors against fp32 of a parallel bf16 run, at most twice those of a single-process bf16 run (``noise``)."""
    for key, value in errors.items():
        assert value <= 2 * noise[key] + 1e-4, (
            f"{key}: parallel bf16 error {value:.2e} > 2 x single-process bf16 error {noise[key]:.2e}"
        )
    return {**errors, **{f"single_process_bf16_{k}": v for k, v in noise.items()}}
