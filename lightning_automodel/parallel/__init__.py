"""Parallelization of Hugging Face models with torch's own DTensor, tensor parallel and FSDP2 (no Lightning)."""

from lightning_automodel.parallel.parallelizer import (
    DefaultParallelizationStrategy,
    ParallelizationStrategy,
    decoder_layers,
    parallelize,
    register_parallelization_strategy,
)
from lightning_automodel.parallel.plans import register_tp_plan, select_tp_plan
from lightning_automodel.parallel.report import PlanReport, plan_report

__all__ = [
    "DefaultParallelizationStrategy",
    "ParallelizationStrategy",
    "PlanReport",
    "decoder_layers",
    "parallelize",
    "plan_report",
    "register_parallelization_strategy",
    "register_tp_plan",
    "select_tp_plan",
]
