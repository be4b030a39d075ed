"""What a parallel layout does, answered without GPUs: what ``parallelize`` makes of a model on a mesh and its memory
per rank (:mod:`.report`, :mod:`.activation_memory`, extrapolated over alike layers by :mod:`.layer_extrapolation`),
the layouts that fit a GPU and their throughput (:mod:`.fitting`, :mod:`.flops`), and whether a tensor-parallel plan
trains right (:mod:`.verify`), on fake process groups and simulated ranks (:mod:`.simulation`)."""

from lightning_automodel.planning.activation_memory import activation_bytes
from lightning_automodel.planning.fitting import Fitting, Hardware, fitting_layouts
from lightning_automodel.planning.flops import flops_per_token
from lightning_automodel.planning.report import PlanReport, plan_report
from lightning_automodel.planning.verify import PlanVerification, verify_plan

__all__ = [
    "Fitting",
    "Hardware",
    "PlanReport",
    "PlanVerification",
    "activation_bytes",
    "fitting_layouts",
    "flops_per_token",
    "plan_report",
    "verify_plan",
]
