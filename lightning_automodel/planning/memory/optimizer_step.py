"""The optimizer step's memory: CausalLMModule's AdamW, built here once for training and the plan alike, and the
temporaries its step allocates on a rank, measured as :mod:`.activations` measures a training step.

torch's foreach AdamW (its default on GPUs) computes the denominator of each (param group, device, dtype)'s update
out of place: a tensor the size of the group's local shards (``_foreach_sqrt`` of ``exp_avg_sq``), held until the
update is applied; the fused kernel updates in place and allocates none. The step runs after backward, when the
activations are freed: a rank's peak is its state (parameters, gradients, AdamW's moments) plus the larger of the
activations and these temporaries (:func:`peak_bytes`), the one rule the plan report and the layout search apply.

The model is parallelized for real in a fake process group, its weights and gradients made fake CPU tensors, and
AdamW steps twice: the first makes its state, torch's ``MemTracker`` follows the second. Nothing is re-derived by
hand; a model of many alike decoder layers is stepped with a few of them and the figure extrapolated (it grows with
the largest group, linearly in the layers), under pp the rank's own stages only.
"""

from __future__ import annotations

from functools import partial
from typing import Literal, get_args

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor

from lightning_automodel.parallel.mesh import ParallelDims
from lightning_automodel.parallel.parallelizer import parallelize
from lightning_automodel.planning.memory.activations import TotalsTracker
from lightning_automodel.planning.memory.layer_extrapolation import over_layers
from lightning_automodel.planning.memory.pipeline_extrapolation import over_stage_layers
from lightning_automodel.planning.simulation import fake_world

AdamWImplementation = Literal["foreach", "fused"]
"""torch's AdamW implementations CausalLMModule offers: ``foreach`` (torch's default on GPUs: a temporary the size
of a param group's shards) or ``fused`` (one kernel, in place)."""

_CPU = torch.device("cpu")


def check_adamw(implementation: str, *, prefix: str = "") -> None:
    """Refuse an AdamW implementation CausalLMModule does not offer (``prefix``: the option's, as the user gave it)."""
    if implementation not in get_args(AdamWImplementation):
        offered = ", ".join(repr(name) for name in get_args(AdamWImplementation))
        raise ValueError(f"{prefix}adamw={implementation!r} is not one of {offered}.")


def adamw(
    parameters: list[nn.Parameter],
    *,
    implementation: AdamWImplementation = "foreach",
    learning_rate: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    weight_decay: float = 0.0,
) -> torch.optim.AdamW:
    """CausalLMModule's AdamW over the trainable ``parameters``: two param groups, weight decay on the matrices and
    none on the vectors (norms, biases), stepped by ``implementation``."""
    check_adamw(implementation)
    groups = [
        {"params": [p for p in parameters if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in parameters if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [group for group in groups if group["params"]], lr=learning_rate, betas=betas, **{implementation: True}
    )


# Bytes per trainable parameter byte kept per rank while training with AdamW besides the parameter: its gradient,
# exp_avg and exp_avg_sq (all in the parameter's dtype); a frozen parameter has none.
_TRAINABLE_COPIES = 3


def training_state_bytes(*, parameters: int, trainable: int) -> int:
    """A rank's state between steps: its ``parameters``' bytes, and for the ``trainable`` bytes among them a gradient
    and AdamW's two moments each."""
    return parameters + _TRAINABLE_COPIES * trainable


def peak_bytes(*, state: int, activations: int, optimizer: int) -> int:
    """A rank's peak in a training step: its ``state`` (parameters, gradients, AdamW's moments) with the larger of
    the step's ``activations`` (freed by the end of backward) and the ``optimizer`` step's temporaries (allocated
    after it)."""
    return state + max(activations, optimizer)


def optimizer_step_bytes(
    model: nn.Module,
    dims: ParallelDims,
    *,
    rank: int = 0,
    implementation: AdamWImplementation = "foreach",
    **options,
) -> int:
    """The bytes CausalLMModule's AdamW step (``implementation``) allocates on ``rank`` at its peak, above the
    parameters, gradients and AdamW state the rank holds.

    ``model`` is on the meta device and is consumed here (pass a copy to keep it); ``options`` are
    :func:`~lightning_automodel.parallel.parallelizer.parallelize`'s (``freeze``: frozen parameters take no step;
    ``pipeline`` under pp, where ``rank`` holds its stages only). Must run outside any process group."""
    check_adamw(implementation)
    pipeline = options.pop("pipeline", None)
    step = partial(_step_temporaries, dims=dims, rank=rank, implementation=implementation, **options)
    if dims.pp > 1:
        return over_stage_layers(step, model, dims=dims, rank=rank, pipeline=pipeline)
    return over_layers(step, model)


def _step_temporaries(
    model: nn.Module, *, dims: ParallelDims, rank: int, implementation: AdamWImplementation, **options
) -> int:
    """The peak of AdamW's second step of ``model``'s shards on ``rank``, above what the rank held before it (see
    :func:`optimizer_step_bytes`).

    AdamW's step works on each tensor by itself, so on a rank it allocates for DTensors what it allocates for their
    local shards: the step runs on plain fake tensors of the shards' shapes, which is several times faster than
    stepping the DTensors (whose every foreach operation propagates placements) and allocates the same (checked to the
    byte against real DTensor steps: ``tests/test_optimizer_step.py``)."""
    with fake_world(dims.world_size, rank=rank):
        parallelize(model, dims.build_mesh("cpu"), **options)
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    if not trained:
        return 0
    shapes = [_local(parameter) for parameter in trained]
    with FakeTensorMode(allow_non_fake_inputs=True) as fake_mode:  # AdamW makes its step counts as real tensors
        shards = [_fake_parameter(shape, dtype) for shape, dtype in shapes]
    try:
        optimizer = adamw(shards, implementation=implementation)
        optimizer.step()  # makes the state
        with TotalsTracker() as tracker:
            tracker.track_external(*shards, optimizer)
            held = tracker.get_tracker_snapshot()[_CPU]["Total"]
            optimizer.step()
            peak = tracker.get_tracker_snapshot("peak")[_CPU]["Total"]
    finally:
        fake_mode.cache_clear()  # its dispatch cache is the class's, and would keep this model's entries
    return peak - held


def _local(parameter: nn.Parameter) -> tuple[torch.Size, torch.dtype]:
    """The shape and dtype of ``parameter`` on this rank: a DTensor's local shard's."""
    local = parameter._local_tensor if isinstance(parameter, DTensor) else parameter
    return local.shape, local.dtype


def _fake_parameter(shape: torch.Size, dtype: torch.dtype) -> nn.Parameter:
    """A fake CPU parameter (in the current fake mode) with a gradient."""
    parameter = nn.Parameter(torch.empty(shape, dtype=dtype, device=_CPU))
    parameter.grad = torch.zeros_like(parameter)
    return parameter
