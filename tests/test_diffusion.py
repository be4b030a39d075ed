"""diffusers' transformer denoisers under the strategy (docs/diffusion.md): found in a LightningModule as transformers'
models are, trained over the data-parallel ranks at parity with one process, and what is not built refused before
any collective."""

from functools import partial

import pytest
import torch
from diffusion_checks import check_denoiser_trains_at_parity

from lightning_automodel.hf.models import find_hf_models
from lightning_automodel.parallel.mesh import ParallelDims
from lightning_automodel.parallel.parallelizer import parallelize
from lightning_automodel.planning.simulation import fake_world
from lightning_automodel.strategy.parallelized_models import models_to_parallelize
from lightning_automodel.testing.denoisers import tiny_denoiser
from lightning_automodel.testing.harness import run_checks
from lightning_automodel.testing.parity import FP32_TOLERANCE


def test_denoisers_train_over_data_parallel_ranks_as_one_process():
    """Flux (two kinds of blocks) and Wan (video latents) at dp_shard=2, Wan with every block checkpointed too."""
    checks = [
        partial(check_denoiser_trains_at_parity, "flux"),
        partial(check_denoiser_trains_at_parity, "wan"),
        partial(check_denoiser_trains_at_parity, "wan", True),
    ]
    results = run_checks(2, checks, timeout=600)
    for name, ranks in results.items():
        for rank in ranks:
            assert rank["first_grads"] < FP32_TOLERANCE, (name, rank)
        print(name, ranks[0])


def test_a_denoiser_is_found_and_what_is_not_built_is_refused():
    """The strategy finds the diffusers model whatever its attribute; tensor, context and pipeline parallel are
    refused with what to use instead; a model built on the meta device is refused (diffusers sets some initial
    weights in its constructors)."""

    class Holder(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.denoiser = model

    model = tiny_denoiser("wan")
    assert find_hf_models(Holder(model)) == [model]
    for dims in (ParallelDims(tp=2), ParallelDims(cp=2), ParallelDims(pp=2)):
        with fake_world(2, rank=0), pytest.raises(ValueError, match=r"trains with dp_shard and dp_replicate"):
            parallelize(tiny_denoiser("wan"), dims.resolve(2).build_mesh("cpu"))
    with torch.device("meta"):
        on_meta = Holder(tiny_denoiser("flux"))
    with pytest.raises(ValueError, match="is on the meta device.*Build it on the CPU"):
        models_to_parallelize(on_meta, strategy_name="AutoModelParallelStrategy", previous=())
