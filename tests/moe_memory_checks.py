"""Checks run on every rank for test_moe_memory.py: the memory a real training step of a mixture-of-experts model
takes on CPU, its router's own routing, to hold the fake-tensor estimate of planning/memory/activations.py (under its
assumed routing) against."""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.distributed as dist
from memory_checks import map_each_large_allocation, resident_peak_above_held
from transformers import AutoModelForCausalLM

from lightning_automodel import ParallelDims
from lightning_automodel.parallel.parallelizer import parallelize
from lightning_automodel.planning.memory.activations import training_step
from lightning_automodel.planning.memory.routing import ExpertRouting, routed
from lightning_automodel.testing.models import tiny_config
from lightning_automodel.testing.peak_memory import peak_above_held

ROWS, TOKENS = 4, 256
# Experts as wide as attention, 8 of them, top-2: the experts' activations are about half of a layer's, so that
# routing shows in the peak. DeepSeek-V3's first layer dense, its attention latent (MLA).
_SIZES = dict(vocab_size=512, hidden_size=128, num_attention_heads=4, max_position_embeddings=1024)
MOE_MODELS = {
    "qwen3_moe": dict(num_hidden_layers=2, num_key_value_heads=2, moe_intermediate_size=256, num_experts=8),
    "deepseek_v3": dict(num_hidden_layers=3, moe_intermediate_size=256, n_routed_experts=8, intermediate_size=512),
}


def moe_model(family: str, *, meta: bool = False) -> torch.nn.Module:
    """``family``'s model of :data:`MOE_MODELS`' sizes, with SDPA; on the meta device if ``meta``."""
    torch.manual_seed(0)
    config = tiny_config(family, **_SIZES, **MOE_MODELS[family])
    config._attn_implementation = "sdpa"
    with torch.device("meta" if meta else "cpu"):
        return AutoModelForCausalLM.from_config(config)


def measured_moe_activation_bytes(
    family: str, dims: ParallelDims, *, routing: ExpertRouting | None = None, **options
) -> dict[str, int]:
    """The bytes one training step of ``family``'s model allocates on this rank at its peak above the parameters and
    gradients it held before (a step ran first): torch's count of the live tensors (``tensors``), as the estimate
    counts its fake ones, and the resident set's (``resident``), as the dense models' are measured. The router's
    own routing, or ``routing``'s, as the estimate assumes it."""
    map_each_large_allocation()
    model = moe_model(family)
    mesh = dims.resolve(dist.get_world_size()).build_mesh("cpu")
    parallelize(model, mesh, **options)
    generator = torch.Generator().manual_seed(dist.get_rank())  # the ranks' rows differ, as in training
    input_ids = torch.randint(_SIZES["vocab_size"], (ROWS, TOKENS), generator=generator)
    step = partial(training_step, model, input_ids=input_ids, mesh=mesh)
    with routed(model, routing) if routing is not None else contextlib.nullcontext():
        step()
        return {"tensors": peak_above_held(step, model), "resident": resident_peak_above_held(step)}
