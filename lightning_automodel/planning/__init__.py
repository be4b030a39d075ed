"""What a parallel layout does, answered without GPUs: what ``parallelize`` makes of a model on a mesh and its memory
per rank (:mod:`.report`, :mod:`.memory`: a training step's activations on fake tensors, extrapolated over alike
layers), the layouts that fit a GPU, the fastest of them and their throughput (:mod:`.search`), and whether a
tensor-parallel plan trains right (:mod:`.verify`), on fake process groups and simulated ranks (:mod:`.simulation`)."""

from lightning_automodel.planning.flops import flops_per_token
from lightning_automodel.planning.memory.activations import activation_bytes
from lightning_automodel.planning.memory.step_options import StepOptions
from lightning_automodel.planning.report import PlanReport, plan_report
from lightning_automodel.planning.search.fitting import (
    Fitting,
    LayoutChoice,
    NoLayoutFits,
    choose_layout,
    fitting_layouts,
)
from lightning_automodel.planning.search.layouts import SearchSpace
from lightning_automodel.planning.search.throughput import Hardware
from lightning_automodel.planning.verify import PlanVerification, verify_plan

__all__ = [
    "Fitting",
    "Hardware",
    "LayoutChoice",
    "NoLayoutFits",
    "PlanReport",
    "PlanVerification",
    "SearchSpace",
    "StepOptions",
    "activation_bytes",
    "choose_layout",
    "fitting_layouts",
    "flops_per_token",
    "plan_report",
    "verify_plan",
]
