"""``verify_plan``: a tensor-parallel plan checked by numbers, on a shrunk replica of the model, in seconds on CPU.

A plan can run and still train wrong (a gradient never summed over tp, a fused projection split across its parts);
nothing crashes, so the only proof is the numbers: one fp32 step against one process (:mod:`.replica_comparison`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from lightning_automodel.hf.peft import unwrap_peft
from lightning_automodel.hf.shrink import heads_for, shrunk_config
from lightning_automodel.parallel.mesh import ParallelDims, tp_mesh
from lightning_automodel.parallel.preflight import check_before_collectives
from lightning_automodel.parallel.tensor.apply import apply_tensor_parallel
from lightning_automodel.parallel.tensor.plans.family import family_plan
from lightning_automodel.parallel.tensor.plans.selection import PlanSpec
from lightning_automodel.planning.child_process import in_child_process
from lightning_automodel.planning.replica_comparison import (
    FP32_TOLERANCE,
    fp32_rounding,
    fp32_sensitivity,
    full_tensor,
    gradient_errors,
    gradient_limits,
    load_weights,
    loss_and_logits,
    nan_as_infinite,
    one_thread,
    relative_error,
    replica_builder,
    token_batch,
    vocabulary_size,
    worst_rounding,
)
from lightning_automodel.planning.simulation import fake_world, simulated_ranks

SHOWN = 8  # gradients listed in the table, worst first


@dataclass
class PlanVerification:
    """What :func:`verify_plan` measured: errors relative to each tensor's largest single-process value (the
    largest over the simulated ranks), per parameter for the gradients; ``problems`` are mismatches of shape or of
    which parameters get a gradient."""

    model_name: str
    tp: int
    sp: bool
    plan_source: str
    replica_parameters: int
    loss_error: float
    logits_error: float
    grad_errors: dict[str, float]
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    tolerance: float = FP32_TOLERANCE
    grad_limits: dict[str, float] = field(default_factory=dict)  # where rounding earns more (see gradient_limits)

    @property
    def worst_gradients(self) -> list[tuple[str, float]]:
        """Parameters by gradient error, worst first (NaN counts as worst)."""
        return sorted(self.grad_errors.items(), key=lambda item: nan_as_infinite(item[1]), reverse=True)

    @property
    def wrong_gradients(self) -> list[str]:
        return [name for name, error in self.worst_gradients if not error < self.limit(name)]

    def limit(self, name: str) -> float:
        return self.grad_limits.get(name, self.tolerance)

    @property
    def passed(self) -> bool:
        return (
            not self.problems
            and self.loss_error < self.tolerance
            and self.logits_error < self.tolerance
            and (not self.wrong_gradients)
        )

    def __str__(self) -> str:
        lines = [
            f"verify_plan: {self.model_name} at tp={self.tp}, sp={self.sp}, with the {self.plan_source}",
            f"replica of {self.replica_parameters:,} parameters, one fp32 step against one process"
            f" ({self.seconds:.1f} s); errors relative to each tensor's largest value:",
            *self._rows(),
            *(f"  {problem}" for problem in self.problems),
        ]
        verdict = "PASSED" if self.passed else "FAILED"
        lines.append(f"{verdict}: tolerance {self.tolerance:.0e}")
        return "\n".join(lines)

    def _rows(self) -> list[str]:
        worst = self.worst_gradients
        rows = [("loss", self.loss_error), ("logits", self.logits_error), *worst[:SHOWN]]
        width = max(len(name) for name, _ in rows)
        lines = [f"  {name:<{width}}  {error:.1e}  {self._mark(name, error)}" for name, error in rows]
        if len(worst) > SHOWN:
            lines.append(f"  ... and {len(worst) - SHOWN} more gradients, the largest error {worst[SHOWN][1]:.1e}")
        return lines

    def _mark(self, name: str, error: float) -> str:
        limit = self.limit(name)
        verdict = "ok" if error < limit else "WRONG"
        return verdict if limit == self.tolerance else f"{verdict} (limit {limit:.0e}: its fp32 rounding)"

    def failure_message(self) -> str:
        """What is wrong, where, and what to do about it; the table follows."""
        found = [*self.problems]
        found += [f"{name} {error:.1e}" for name, error in (("loss", self.loss_error), ("logits", self.logits_error))
                  if not error < self.tolerance]  # fmt: skip
        wrong = self.wrong_gradients
        if wrong:
            shown = ", ".join(f"{name} ({self.grad_errors[name]:.1e})" for name in wrong[:4])
            found.append(f"the gradients of {len(wrong)} parameters, worst {shown}")
        return (
            f"The {self.plan_source} trains {self.model_name} wrong at tp={self.tp}, sp={self.sp}: one"
            f" tensor-parallel step of a shrunk replica differs from one process in {'; '.join(found)} (tolerance"
            f" {self.tolerance:.0e}, relative). {FIX}\n{self}"
        )


# What a failed verification advises.
FIX = (
    "A parameter whose gradient alone is wrong usually computes on activations the plan splits (a per-head norm, a"
    " fused projection split across its parts). Pass tp_plan= with styles that fit those modules (or that leave their"
    " projections whole, with allow_unsharded_linears=True), or register a plan for the class with register_tp_plan"
    " and verify it again; or use tp=1."
)


def verify_plan(
    model_or_config: Any,
    *,
    tp: int = 2,
    sp: bool = False,
    tp_plan: PlanSpec | None = None,
    allow_unsharded_linears: bool = False,
    raise_on_failure: bool = True,
) -> PlanVerification:
    """Verify the tensor-parallel plan ``parallelize`` gives ``model_or_config`` (a Hugging Face model, on any
    device, or its config) with these options, on a replica of the same class from a shrunk config
    (:func:`~lightning_automodel.hf.shrink.shrunk_config`); see :func:`verify_replica`.

    A plan ``parallelize`` refuses is refused here with the same error. ``raise_on_failure``: raise a ValueError
    naming the worst parameters and the fix when the numbers differ; otherwise return the verification either way.
    Inside a process group the job goes to a child process (:mod:`.child_process`): ``tp_plan`` must then pickle (a
    dict of styles, an import path, or a function importable by its module's name).
    """
    if tp < 2:
        raise ValueError(f"verify_plan checks a tensor-parallel plan: tp={tp} has none; pass tp=2 or more.")
    model_class, config = _class_and_config(model_or_config)
    job = dict(
        model_class=model_class,
        config=shrunk_config(config, heads=heads_for(tp)),
        tp=tp,
        sp=sp,
        tp_plan=tp_plan,
        allow_unsharded_linears=allow_unsharded_linears,
    )
    verification = in_child_process(verify_replica, job) if dist.is_initialized() else verify_replica(**job)
    if raise_on_failure and not verification.passed:
        raise ValueError(verification.failure_message())
    return verification


def verify_replica(
    *,
    model_class: type[nn.Module] | None,
    config: Any,
    tp: int,
    sp: bool,
    tp_plan: PlanSpec | None,
    allow_unsharded_linears: bool,
) -> PlanVerification:
    """One step of a model built from ``config`` (already small) in one process and over ``tp`` ranks simulated in
    this process (:mod:`.simulation`: no port, no process group), through the strategy's own flow: built on the meta
    device, the checks, plan and probe of ``parallelize``, then given the reference's weights shard by shard. FSDP2
    is left out: torch's simulation cannot run it, and it changes no number the plan decides."""
    start = time.perf_counter()
    build = replica_builder(model_class, config)
    with torch.device("meta"):
        model = build()
    with fake_world(tp), one_thread():
        mesh = ParallelDims(tp=tp).resolve(tp).build_mesh("cpu")
        # Refusals first, as in training. The checks only propagate shapes on the meta device: rank 0's view serves.
        planned = check_before_collectives(
            model, mesh, sp=sp, tp_plan=tp_plan, allow_unsharded_linears=allow_unsharded_linears
        ).planned
        torch.manual_seed(0)
        reference = build()
        tokens, labels = token_batch(vocabulary_size(reference))
        expected_loss, expected_logits = loss_and_logits(reference, tokens, labels)
        expected_loss.backward()
        limits = gradient_limits(
            worst_rounding(fp32_rounding(reference, tokens, labels), fp32_sensitivity(reference, tokens, labels))
        )
        with simulated_ranks(tp):
            apply_tensor_parallel(model, tp_mesh(mesh), planned)
            load_weights(model, reference)
            with loss_parallel():
                loss, logits = loss_and_logits(model, tokens, labels)
                loss.backward()
            grad_errors, one_sided = gradient_errors(model, reference)
            verification = PlanVerification(
                model_name=type(reference).__name__,
                tp=tp,
                sp=sp,
                plan_source=planned.choice.source,
                replica_parameters=sum(p.numel() for p in reference.parameters()),
                loss_error=relative_error(full_tensor(loss), expected_loss.detach()),
                logits_error=relative_error(full_tensor(logits), expected_logits.detach()),
                grad_errors=grad_errors,
                problems=one_sided,
                grad_limits=limits,
            )
    verification.seconds = time.perf_counter() - start
    return verification


def plan_unregistered(model: nn.Module, tp_plan: PlanSpec | None) -> bool:
    """Whether ``model``'s plan is one no family registered, which the tests do not check by class: the user's
    (``tp_plan``), or the model's own Hugging Face plan or the default one for a class without a family plan."""
    return tp_plan is not None or family_plan(type(model).__name__) is None


def _class_and_config(model_or_config: Any) -> tuple[type[nn.Module] | None, Any]:
    """The model class to replicate (None: the causal LM class transformers maps the config to) and its config."""
    from transformers import PretrainedConfig, PreTrainedModel

    if isinstance(model_or_config, PretrainedConfig):
        return None, model_or_config
    model = unwrap_peft(model_or_config)
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"verify_plan needs a Hugging Face model (transformers.PreTrainedModel) or its config, got"
            f" {type(model_or_config).__name__}: it builds a shrunk replica from the config."
        )
    return type(model), model.config
