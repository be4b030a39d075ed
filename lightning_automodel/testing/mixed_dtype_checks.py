"""Mixed-dtype models under FSDP2, inside gloo workers: Ernie 4.5 MoE, whose router Hugging Face pins to fp32.

Its router computes in fp32 whatever dtype the rest of the model has (it casts its input and weight), so the
model runs with the router in a dtype of its own, and stock per-layer FSDP2 refuses it.
"""

from __future__ import annotations

from unittest import TestCase

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard

from lightning_automodel import parallelize
from lightning_automodel.parallel import decoder_layers
from lightning_automodel.parallel.fsdp.dtypes import keep_pinned_fp32
from lightning_automodel.parallel.mesh import data_mesh
from lightning_automodel.parallel.parallelizer import fp32_pinned_names
from lightning_automodel.testing.models import tiny_model
from lightning_automodel.testing.parity import (
    BF16,
    check_training,
    dims_for,
    forward_backward_errors,
    within_bf16_noise,
)


def ernie(seed: int = 0, router: torch.dtype = torch.float32, rest: torch.dtype = torch.float32) -> torch.nn.Module:
    model = tiny_model("ernie_moe", seed=seed)
    with keep_pinned_fp32(model, fp32_pinned_names(model)):
        model.to(rest)
    for layer in decoder_layers(model):
        layer.mlp.gate.to(router)
    return model


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [layer.mlp.gate for layer in decoder_layers(model)]


def check_stock_fsdp_refuses_mixed_dtypes() -> str:
    """What fully_shard_by_dtype fixes: one FSDP unit per layer fails on the fp32 router of a bf16 model."""
    mesh = dims_for(dist.get_world_size(), 1).build_mesh("cpu")
    model = ernie(rest=torch.bfloat16)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh["dp_shard_cp"])
    fully_shard(model, mesh=mesh["dp_shard_cp"])
    with TestCase().assertRaisesRegex(AssertionError, "uniform original parameter dtype") as error:
        model(torch.ones(1, 4, dtype=torch.long))
    return str(error.exception)


def check_float64_router_training() -> dict[str, float]:
    """Exact parity of a model with two storage dtypes (fp64 routers in an fp32 model): the routers are FSDP units
    of their own, and loss, logits, every gradient and the weights after AdamW steps match a single process."""
    mesh = dims_for(dist.get_world_size(), 1).build_mesh("cpu")
    reference = ernie(router=torch.float64)
    model = ernie(seed=dist.get_rank(), router=torch.float64)
    parallelize(model, mesh)
    for router in routers(model):
        assert isinstance(router, FSDPModule) and router.weight.dtype == torch.float64, router
    return check_training(model, reference, data_mesh(mesh))


def check_bf16_model_with_fp32_router(mixed_precision: bool) -> dict[str, float]:
    """The two ways a Hugging Face model keeps its router in fp32 beside bf16 compute, as close to an fp32 run as a
    single-process bf16 run with an fp32 router is:

    * bf16 weights with fp32 routers (``from_pretrained(dtype=torch.bfloat16)``, ``Trainer(precision="bf16-true")``):
      each unit computes in its storage dtype;
    * fp32 weights with a bf16 mixed-precision policy (``"bf16-mixed"``): the routers, pinned by
      ``_keep_in_fp32_modules_strict``, gather, compute and reduce in fp32; everything else in bf16.
    """
    mesh = dims_for(dist.get_world_size(), 1).build_mesh("cpu")
    if mixed_precision:
        model = ernie()
        parallelize(model, mesh, mp_policy=BF16)
        layer_policy = decoder_layers(model)[0]._get_fsdp_state()._mp_policy
        assert layer_policy.param_dtype == torch.bfloat16, layer_policy
    else:
        model = ernie(rest=torch.bfloat16)
        parallelize(model, mesh)
    for router in routers(model):
        policy = router._get_fsdp_state()._mp_policy
        assert policy.param_dtype in (None, torch.float32) and router.weight.dtype == torch.float32, policy
    if mixed_precision:
        assert (policy.reduce_dtype, policy.output_dtype) == (torch.float32, torch.float32), policy
    errors = forward_backward_errors(model, ernie(), data_mesh(mesh))
    noise = forward_backward_errors(ernie(rest=torch.bfloat16), ernie(), None)
    return within_bf16_noise(errors, noise)
