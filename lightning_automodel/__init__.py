"""lightning-automodel: one-line model parallelism for Hugging Face models in PyTorch Lightning."""

from lightning_automodel.mesh import ParallelDims
from lightning_automodel.parallel import (
    parallelize,
    plan_report,
    register_parallelization_strategy,
    register_tp_plan,
)
from lightning_automodel.strategy import AutoModelParallelStrategy

__all__ = [
    "AutoModelParallelStrategy",
    "ParallelDims",
    "parallelize",
    "plan_report",
    "register_parallelization_strategy",
    "register_tp_plan",
]
