"""Every axis of the 5D mesh applied to a Hugging Face model with torch's own DTensor, pipelining and FSDP2, without
Lightning: a folder per axis (:mod:`.tensor`, :mod:`.pipeline`, :mod:`.context_parallel`, :mod:`.experts`,
:mod:`.fsdp`), the mesh (:mod:`.mesh`), and :func:`parallelize` (:mod:`.parallelizer`) putting them in order; what it
returns, :class:`Parallelized` (:mod:`.parallelized`), holds what a training loop calls at each step."""

from lightning_automodel.hf.decoder_layers import decoder_layers
from lightning_automodel.parallel import anomaly  # noqa: F401  (registers a DTensor rule anomaly mode needs)
from lightning_automodel.parallel.fsdp.dtypes import iter_maximal_uniform_dtype_subtrees
from lightning_automodel.parallel.fsdp.options import FSDPOptions
from lightning_automodel.parallel.fsdp.sharding import fully_shard_by_dtype
from lightning_automodel.parallel.loss import causal_lm_loss, global_token_mean
from lightning_automodel.parallel.options import ParallelOptions
from lightning_automodel.parallel.parallelized import Parallelized
from lightning_automodel.parallel.parallelizer import (
    DefaultParallelizationStrategy,
    ParallelizationStrategy,
    parallelize,
    register_parallelization_strategy,
)
from lightning_automodel.parallel.tensor.plans.family import register_tp_plan
from lightning_automodel.parallel.tensor.plans.selection import select_tp_plan

__all__ = [
    "DefaultParallelizationStrategy",
    "FSDPOptions",
    "ParallelOptions",
    "Parallelized",
    "ParallelizationStrategy",
    "causal_lm_loss",
    "decoder_layers",
    "fully_shard_by_dtype",
    "global_token_mean",
    "iter_maximal_uniform_dtype_subtrees",
    "parallelize",
    "register_parallelization_strategy",
    "register_tp_plan",
    "select_tp_plan",
]
