"""The Hugging Face models of a LightningModule that the strategy casts, parallelizes and materializes, and the
modules it leaves alone (parallelized by themselves) or refuses (FSDP1)."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Collection
from contextlib import ExitStack

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor

from lightning_automodel.hf.denoisers import is_denoiser
from lightning_automodel.hf.initialization import materialize_hf_model
from lightning_automodel.hf.loading import materialize_pretrained, pretrained_checkpoint
from lightning_automodel.hf.models import find_hf_models
from lightning_automodel.parallel.fsdp.dtypes import keep_pinned_fp32
from lightning_automodel.parallel.initial_weights import is_meta
from lightning_automodel.parallel.parallelizer import fp32_pinned_names

log = logging.getLogger(__name__)

# Models this package parallelized, so a later stage on the same module does not mistake them for the user's.
PARALLELIZED_BY_US: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def models_to_parallelize(
    module: nn.Module, *, strategy_name: str, previous: Collection[nn.Module]
) -> list[nn.Module] | None:
    """The Hugging Face models of ``module`` (those parallelized by us in an earlier stage among them), or None for
    a module that parallelized itself. ``previous``: the models of the stage before, whose replacement is warned of.
    """
    models = find_hf_models(module)
    ours = bool(models) and all(model in PARALLELIZED_BY_US for model in models)
    if not ours and is_parallelized(module):
        name = type(module).__name__
        log.info("%s is already parallelized (DTensor or FSDP2 parameters); leaving it as it is.", name)
        return None
    if not models:
        raise TypeError(
            f"{strategy_name} found no Hugging Face model (transformers.PreTrainedModel, or a diffusers transformer) in"
            f" {type(module).__name__}. Assign the model to an attribute in __init__ or configure_model"
            " (e.g. self.model = AutoModelForCausalLM.from_config(config)), or parallelize it yourself in"
            " configure_model."
        )
    for model in models:
        _refuse_a_denoiser_on_meta(model)
    if previous and not any(model in previous for model in models):
        rank_zero_warn(
            f"{type(module).__name__} holds a new model in this stage: the one trained before was replaced"
            " (configure_model runs at every stage). Guard it with `if self.model is not None: return`."
        )
    return models


def _refuse_a_denoiser_on_meta(model: nn.Module) -> None:
    """A diffusers transformer built on the meta device cannot be given its initial weights: diffusers sets some in
    its modules' constructors (zeros, constants), which no initialisation after the fact reproduces."""
    if is_denoiser(model) and is_meta(model) and model not in PARALLELIZED_BY_US:
        raise ValueError(
            f"{type(model).__name__} is on the meta device, and diffusers sets some of its initial weights in its"
            " modules' constructors, which a model built there cannot reproduce. Build it on the CPU (rank 0's weights"
            " are broadcast to every rank) or load it with from_pretrained."
        )


def is_parallelized(module: nn.Module) -> bool:
    return any(isinstance(m, FSDPModule) for m in module.modules()) or any(
        isinstance(p, DTensor) for p in module.parameters()
    )


def convert_keeping_pinned_fp32(module: nn.Module, convert: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """``convert(module)`` (a precision plugin's cast), but what its models pin to fp32 stays fp32, as in Hugging
    Face's ``from_pretrained(dtype=torch.bfloat16)``."""
    with ExitStack() as pinned:
        for model in find_hf_models(module):
            pinned.enter_context(keep_pinned_fp32(model, fp32_pinned_names(model)))
        return convert(module)


def materialize(model: nn.Module, device: torch.device) -> None:
    """Give a model parallelized on the meta device its weights on ``device``: its pretrained ones, or its own
    initialisation's."""
    if pretrained_checkpoint(model) is not None:
        materialize_pretrained(model, device)
    else:
        materialize_hf_model(model, device)


def refuse_fsdp1(module: nn.Module) -> None:
    """FSDP1 (``FullyShardedDataParallel``) wraps parameters in flat buffers that tensor parallel and FSDP2 cannot
    shard underneath; refused as Lightning's ModelParallelStrategy refuses it."""
    if any(isinstance(child, FullyShardedDataParallel) for child in module.modules()):
        raise TypeError(
            f"{type(module).__name__} holds modules wrapped in torch.distributed.fsdp.FullyShardedDataParallel"
            " (FSDP1). AutoModelParallelStrategy shards with FSDP2 itself: remove the wrapper and set dp_shard /"
            " dp_replicate on the strategy, or apply FSDP2's fully_shard in configure_model yourself."
        )
