"""Plan report: what parallelize() would do to a model on a mesh, computed without GPUs or real weights.

The model is built (or kept) on the meta device and parallelized for real inside a fake process group of the
requested world size, so the per-rank shapes are the ones training would get, not a re-derivation that could
drift from the code. An 8B-parameter config takes seconds.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.tensor import DTensor

from lightning_automodel.mesh import ParallelDims
from lightning_automodel.parallel.parallelizer import check_before_collectives, parallelize
from lightning_automodel.parallel.patterns import pattern_matches
from lightning_automodel.parallel.plans import PlanSpec
from lightning_automodel.parallel.simulation import fake_world

# Bytes per parameter byte kept per rank while training with AdamW: the parameter, its gradient, exp_avg and
# exp_avg_sq (all in the parameter's dtype). Activations come on top and depend on the batch.
_TRAINING_COPIES = 4


@dataclass
class PlanReport:
    model_name: str
    dims: ParallelDims
    plan_source: str
    plan_reason: str = ""
    styles: dict[str, tuple[str, int]] = field(default_factory=dict)  # pattern -> (style, modules matched)
    unmatched_patterns: list[str] = field(default_factory=list)
    unsharded_weights: list[str] = field(default_factory=list)
    replicated: dict[str, int] = field(default_factory=dict)  # modules on sharded activations, as patterns -> count
    total_parameters: int = 0
    parameters_per_rank: int = 0
    parameter_bytes_per_rank: int = 0

    @property
    def training_bytes_per_rank(self) -> int:
        """Parameters + gradients + AdamW state on one rank (activations not included)."""
        return _TRAINING_COPIES * self.parameter_bytes_per_rank

    def __str__(self) -> str:
        lines = [
            f"{self.model_name} on {self.dims}",
            f"tensor-parallel plan: {self.plan_source} ({self.plan_reason})"
            if self.dims.tp > 1
            else "tensor parallel: off (tp=1)",
        ]
        width = max((len(pattern) for pattern in [*self.styles, *self.replicated]), default=0)
        lines += [f"  {p:<{width}}  {style} x{count}" for p, (style, count) in self.styles.items()]
        lines += [f"  {p:<{width}}  ReplicateOnShardedInput x{count}" for p, count in self.replicated.items()]
        if self.unmatched_patterns:
            lines.append(f"patterns matching no module: {', '.join(self.unmatched_patterns)}")
        if self.unsharded_weights:
            lines.append(f"large block weights left whole on every tp rank: {', '.join(self.unsharded_weights)}")
        if self.dims.ep > 1:
            lines.append(
                f"expert parallel: ep={self.dims.ep}, each rank holds 1/{self.dims.ep} of every layer's experts,"
                f" FSDP-sharded over efsdp={self.dims.efsdp}"
            )
        share = self.parameters_per_rank / max(self.total_parameters, 1)
        lines += [
            f"parameters: {self.total_parameters:,} in all, {self.parameters_per_rank:,} per rank"
            f" ({share:.2%}; ideal 1/{self.dims.tp * self.dims.dp_shard * self.dims.cp})",
            f"memory per rank: {_gib(self.parameter_bytes_per_rank)} parameters,"
            f" {_gib(self.training_bytes_per_rank)} with gradients and AdamW state (activations not included)",
        ]
        return "\n".join(lines)


def plan_report(
    model: nn.Module,
    dims: ParallelDims,
    *,
    sp: bool = False,
    tp_plan: PlanSpec | None = None,
    allow_unsharded_linears: bool = False,
    rank: int = 0,
) -> PlanReport:
    """Parallelize ``model`` (on the meta device) as ``rank`` of a fake world of ``dims`` and describe the result.

    ``dims`` must be resolved (a world size is needed). Must be called outside any real process group. A plan that
    training would refuse is refused here too, with the same message.
    """
    if not all(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        raise ValueError("plan_report needs a model on the meta device: build it under `with torch.device('meta'):`.")
    report = PlanReport(type(model).__name__, dims, plan_source="")
    report.total_parameters = sum(p.numel() for p in model.parameters())
    with fake_world(dims.world_size, rank=rank):
        mesh = dims.build_mesh("cpu")
        planned = check_before_collectives(
            model, mesh, sp=sp, tp_plan=tp_plan, allow_unsharded_linears=allow_unsharded_linears
        ).planned
        if planned is not None:
            choice = planned.choice
            report.plan_source, report.plan_reason = choice.source, choice.reason
            names = [name for name, _ in model.named_modules()]
            for pattern, style in choice.plan.items():
                report.styles[pattern] = (type(style).__name__, sum(pattern_matches(pattern, name) for name in names))
            report.unmatched_patterns = choice.unmatched
            report.unsharded_weights = choice.unsharded_weights
            report.replicated = dict(Counter(re.sub(r"\.\d+\.", ".*.", name) for name in planned.replicated))
        parallelize(model, mesh, sp=sp, tp_plan=tp_plan, allow_unsharded_linears=allow_unsharded_linears)
        local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    report.parameters_per_rank = sum(t.numel() for t in local)
    report.parameter_bytes_per_rank = sum(t.numel() * t.element_size() for t in local)
    return report


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"
