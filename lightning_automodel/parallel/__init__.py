"""Parallelization of Hugging Face models with torch's own DTensor, tensor parallel and FSDP2 (no Lightning)."""

from lightning_automodel.parallel.parallelizer import (
    DefaultParallelizationStrategy,
    ParallelizationStrategy,
    decoder_layers,
    parallelize,
    register_parallelization_strategy,
)
from lightning_automodel.parallel.plans import register_tp_plan, select_tp_plan

__all__ = [
    "DefaultParallelizationStrategy",
    "ParallelizationStrategy",
    "decoder_layers",
    "parallelize",
    "register_parallelization_strategy",
    "register_tp_plan",
    "select_tp_plan",
]
