"""lightning-automodel: one-line model parallelism for Hugging Face models in PyTorch Lightning.

The names below are imported on first use (PEP 562), so that a process that needs one part of the package (the
planner's child processes: no Lightning, no checkpoint I/O) starts without importing the rest.
"""

# ruff: noqa: E402 - the filter below is installed before the imports that follow

# First, before any module of the package imports transformers, whose first import loads torchao: torchao's notice that
# it skips its C++ extensions is dropped (see hf/torchao_notice.py). Every import of the package runs this file first.
from lightning_automodel.hf.torchao_notice import drop_torchao_extensions_notice

drop_torchao_extensions_notice()

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_automodel.hf.loading import from_pretrained
    from lightning_automodel.io.hf_export import export_hf, export_merged, export_peft_adapter
    from lightning_automodel.parallel import (
        causal_lm_loss,
        fully_shard_by_dtype,
        global_token_mean,
        iter_maximal_uniform_dtype_subtrees,
        parallelize,
        register_parallelization_strategy,
        register_tp_plan,
    )
    from lightning_automodel.parallel.mesh import ParallelDims
    from lightning_automodel.planning.report import plan_report
    from lightning_automodel.planning.verify import verify_plan
    from lightning_automodel.strategy import AutoModelParallelStrategy

__all__ = [
    "AutoModelParallelStrategy",
    "ParallelDims",
    "causal_lm_loss",
    "export_hf",
    "export_merged",
    "export_peft_adapter",
    "from_pretrained",
    "fully_shard_by_dtype",
    "global_token_mean",
    "iter_maximal_uniform_dtype_subtrees",
    "parallelize",
    "plan_report",
    "register_parallelization_strategy",
    "register_tp_plan",
    "verify_plan",
]

# The module each of them is imported from, on first use.
_HOMES = {
    "lightning_automodel.strategy": ("AutoModelParallelStrategy",),
    "lightning_automodel.parallel.mesh": ("ParallelDims",),
    "lightning_automodel.io.hf_export": ("export_hf", "export_merged", "export_peft_adapter"),
    "lightning_automodel.hf.loading": ("from_pretrained",),
    "lightning_automodel.planning.report": ("plan_report",),
    "lightning_automodel.planning.verify": ("verify_plan",),
    "lightning_automodel.parallel": (
        "causal_lm_loss",
        "fully_shard_by_dtype",
        "global_token_mean",
        "iter_maximal_uniform_dtype_subtrees",
        "parallelize",
        "register_parallelization_strategy",
        "register_tp_plan",
    ),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str) -> Any:
    if name not in _HOME_OF:
        raise AttributeError(f"module 'lightning_automodel' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME_OF[name]), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
