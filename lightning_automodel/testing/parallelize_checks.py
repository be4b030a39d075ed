"""``parallelize`` against one process, inside gloo workers (see :mod:`lightning_automodel.testing.parity`): fp32 and
bf16 layouts, the families' registered plans, gradient clipping over every mesh, and FSDP's reshard and prefetch
schedule. Every rank builds its model from the same seed unless a check says otherwise; each check returns its errors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_automodel import parallelize
from lightning_automodel.parallel import decoder_layers
from lightning_automodel.parallel.grad_norm import clip_grad_norm_
from lightning_automodel.parallel.mesh import data_mesh
from lightning_automodel.testing.models import tiny_model
from lightning_automodel.testing.parity import (
    BF16,
    FP32_TOLERANCE,
    dims_for,
    forward_backward_errors,
    relative_error,
    within_bf16_noise,
)


def check_layout(tp: int, sp: bool, activation_checkpointing: bool | str, dp_replicate: int = 1) -> dict[str, float]:
    """fp32 parity of one layout; dp_shard takes the rest of the world.

    Every rank builds its model from a different seed: parallelize must make them all rank 0's.
    """
    mesh = dims_for(dist.get_world_size(), tp, dp_replicate).build_mesh("cpu")
    reference, model = tiny_model(), tiny_model(seed=dist.get_rank())
    parallelize(model, mesh, sp=sp, activation_checkpointing=activation_checkpointing)
    errors = forward_backward_errors(model, reference, data_mesh(mesh))
    assert max(errors.values()) < FP32_TOLERANCE, errors
    return errors


def check_bf16_layout(tp: int, sp: bool) -> dict[str, float]:
    """bf16 mixed precision: as close to the exact (fp32) result as a single-process bf16 run is.

    bf16 keeps 8 bits of mantissa, so no fixed tolerance is meaningful across quantities. The yardstick is the
    error of a single-process bf16 run of the same model against fp32: the parallel bf16 run reorders the same
    bf16 operations (TP partial sums are reduced in bf16, FSDP gradients in fp32), so its error against fp32
    must be of the same size; we allow twice it. A sharding bug gives errors of order 1, far above.
    """
    mesh = dims_for(dist.get_world_size(), tp).build_mesh("cpu")
    model = tiny_model()
    parallelize(model, mesh, sp=sp, mp_policy=BF16)
    errors = forward_backward_errors(model, tiny_model(), data_mesh(mesh))
    noise = forward_backward_errors(tiny_model().to(torch.bfloat16), tiny_model(), None)
    return within_bf16_noise(errors, noise)


def check_family(family: str, sp: bool) -> dict[str, float]:
    """fp32 parity of a family's registered plan at tp=2 (dp_shard takes the rest of the world)."""
    mesh = dims_for(dist.get_world_size(), 2).build_mesh("cpu")
    reference, model = tiny_model(family), tiny_model(family)
    tied = _embeddings_tied(model)
    parallelize(model, mesh, sp=sp)
    assert _embeddings_tied(model) == tied, "tensor parallel changed whether lm_head is tied to the embedding"
    errors = forward_backward_errors(model, reference, data_mesh(mesh))
    assert max(errors.values()) < FP32_TOLERANCE, errors
    return errors


def check_clip_grad_norm(tp: int, sp: bool) -> dict[str, float]:
    """The global gradient norm over parameters on different meshes equals the single-process one, and so do
    the clipped gradients."""
    mesh = dims_for(dist.get_world_size(), tp).build_mesh("cpu")
    reference, model = tiny_model(), tiny_model()
    parallelize(model, mesh, sp=sp)
    forward_backward_errors(model, reference, data_mesh(mesh))
    norm = clip_grad_norm_(model.parameters(), max_norm=0.1)
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.1)
    assert ref_norm > 0.1, "the test must clip"
    ref_grads = dict(reference.named_parameters())
    errors = {
        "norm": relative_error(norm, ref_norm),
        "clipped_grad": max(relative_error(p.grad, ref_grads[name].grad) for name, p in model.named_parameters()),
    }
    assert max(errors.values()) < FP32_TOLERANCE, errors
    return errors


def _embeddings_tied(model: torch.nn.Module) -> bool:
    output = model.get_output_embeddings()
    return output is not None and output.weight is model.get_input_embeddings().weight


def check_fsdp_schedule(reshard_after_forward: bool | None, forward_prefetch: int, backward_prefetch: int) -> dict:
    """The reshard and prefetch options set what they say on every unit, and leave the results exact."""
    mesh = dims_for(dist.get_world_size(), 1).build_mesh("cpu")
    reference, model = tiny_model(num_hidden_layers=4), tiny_model(num_hidden_layers=4)
    parallelize(
        model,
        mesh,
        reshard_after_forward=reshard_after_forward,
        forward_prefetch=forward_prefetch,
        backward_prefetch=backward_prefetch,
    )
    layers = decoder_layers(model)
    states = [unit._get_fsdp_state() for unit in (*layers, model)]
    reshards = [state._fsdp_param_group.post_forward_mesh_info is not None for state in states]
    if reshard_after_forward is None:
        assert reshards == [True, True, True, False, False], reshards  # every layer but the last; not the root
    else:
        assert reshards == [reshard_after_forward] * 5, reshards
    index = {id(layer): i for i, layer in enumerate(layers)}
    forward = [[index[id(s._modules[0])] for s in state._states_to_forward_prefetch] for state in states[:4]]
    backward = [[index[id(s._modules[0])] for s in state._states_to_backward_prefetch] for state in states[:4]]
    ahead = [list(range(i + 1, min(4, i + 1 + forward_prefetch))) for i in range(4)]
    behind = (
        [list(range(i - 1, max(-1, i - 1 - backward_prefetch), -1)) for i in range(4)]
        if backward_prefetch > 1
        else [[]] * 4
    )
    assert forward == ahead and backward == behind, (forward, backward)
    errors = forward_backward_errors(model, reference, data_mesh(mesh))
    errors.update(forward_backward_errors(model, reference, data_mesh(mesh)))  # a second pass, after resharding
    assert max(errors.values()) < FP32_TOLERANCE, errors
    return errors
