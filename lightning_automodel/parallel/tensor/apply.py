"""Tensor parallel for one model: its plan chosen and checked on a meta-device copy, then the model sharded with it.

Everything that can refuse (the plan's choice, the modules its styles are given, one probe step of the sharded copy)
happens on the copy, before any collective and alike on every rank; the model is then sharded with exactly that.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from lightning_automodel.hf.decoder_layers import named_language_layers
from lightning_automodel.hf.ties import ties_kept
from lightning_automodel.parallel.probe.remembered import remembered
from lightning_automodel.parallel.probe.step import ProbeError, Trace, meta_copy, probe
from lightning_automodel.parallel.tensor.head_counts import head_parameter_styles, localize_head_counts, splits_outputs
from lightning_automodel.parallel.tensor.lora import lora_aware
from lightning_automodel.parallel.tensor.plans.patterns import pattern_matches
from lightning_automodel.parallel.tensor.plans.selection import PlanChoice, PlanSpec, select_tp_plan
from lightning_automodel.parallel.tensor.plans.tower import kept_whole_for, with_tower_plan
from lightning_automodel.parallel.tensor.sharded_activations import LayoutMismatch, find_sharded_activations

log = logging.getLogger(__name__)


@dataclass
class TensorParallelPlan:
    """What :func:`apply_tensor_parallel` does to a model: the chosen plan, LoRA-aware, with the styles the probe
    added (by exact module name) for modules computing on sharded activations."""

    choice: PlanChoice
    styles: dict[str, ParallelStyle]
    replicated: list[str] = field(default_factory=list)  # modules given ReplicateOnShardedInput
    head_counts: list[str] = field(default_factory=list)  # attributes made this rank's (module.attribute)


def plan_tensor_parallel(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    sp: bool,
    tp_plan: PlanSpec | None = None,
    allow_unsharded_linears: bool = False,
    unsharded: Trace | ProbeError | None = None,
) -> TensorParallelPlan:
    """Choose and check the plan for ``model`` over the tp ``mesh``, on a meta-device copy; no collective runs.

    ``unsharded``: a probe of the model as it is (see :func:`~lightning_automodel.parallel.probe.step.probe`): the
    language model's blocks it runs are those the plan must shard, and the sharded copy is probed against it. A
    vision-language model's tower and projector get the derived plan's styles where its step ran their images (see
    :mod:`.plans.tower`); a tower plan the probe refuses leaves them whole (the report says why). A model the probe
    could not run is refused once its plan is chosen (so that a plan's own shortcomings are named first); without a
    probe (a model that is not a Hugging Face one) the plan is applied to the copy, not probed.
    """
    plan = partial(
        _planned,
        model,
        mesh,
        sp=sp,
        tp_plan=tp_plan,
        allow_unsharded_linears=allow_unsharded_linears,
        unsharded=unsharded,
    )
    if tp_plan is not None and not isinstance(tp_plan, str):  # a user's styles or function: nothing to know it by
        return plan()
    how = ("tp plan", mesh.device_type, mesh.size(), sp, tp_plan, allow_unsharded_linears)
    found = remembered(model, how=how, probe=plan)  # the unsharded probe is the model's: remembered with it
    return dataclasses.replace(
        found, styles=dict(found.styles), replicated=list(found.replicated), head_counts=list(found.head_counts)
    )


def _planned(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    sp: bool,
    tp_plan: PlanSpec | None,
    allow_unsharded_linears: bool,
    unsharded: Trace | ProbeError | None,
) -> TensorParallelPlan:
    blocks = named_language_layers(model)  # a vision tower's plan is added to the language model's
    if isinstance(unsharded, Trace):
        blocks = [(name, block) for name, block in blocks if unsharded.called(name)]
    trace = unsharded if isinstance(unsharded, Trace) else None
    choice = select_tp_plan(
        model, sp=sp, tp_plan=tp_plan, allow_unsharded_linears=allow_unsharded_linears, blocks=blocks, trace=trace
    )
    if isinstance(unsharded, ProbeError):
        raise ValueError(
            f"lightning_automodel checks a tensor-parallel plan on one step of the model on the meta device, and"
            f" {type(model).__name__} fails there by itself, in {unsharded.module or 'backward'} ({unsharded.detail})."
            " Use tp=1: FSDP2 alone needs no such check."
        ) from unsharded
    tower = with_tower_plan(model, choice, trace=trace) if tp_plan is None else choice
    if tower.plan == choice.plan:  # nothing beside the language model split (the reasons say why), or a user's plan
        return _checked(model, mesh, tower, sp=sp, unsharded=unsharded)
    try:
        return _checked(model, mesh, tower, sp=sp, unsharded=unsharded)
    except ValueError as error:  # the language model's plan alone is checked next, and refused as it would be
        why = f"the plan for them fails the probe's step ({str(error).split('. ')[0]})"
        return _checked(model, mesh, kept_whole_for(model, choice, reason=why), sp=sp, unsharded=unsharded)


def _checked(
    model: nn.Module, mesh: DeviceMesh, choice: PlanChoice, *, sp: bool, unsharded: Trace | None
) -> TensorParallelPlan:
    """``choice`` applied to a meta-device copy of ``model`` and, with a probe, probed there (see
    :func:`_probe_sharded`)."""
    copy = meta_copy(model)
    styles = lora_aware(choice.plan, copy)
    split = _shard_keeping_ties(copy, mesh, styles)
    per_head = head_parameter_styles(copy, split=split)
    _shard_keeping_ties(copy, mesh, per_head)
    styles = {**styles, **per_head}
    planned = TensorParallelPlan(choice, styles, head_counts=localize_head_counts(copy, mesh.size(), split=split))
    if isinstance(unsharded, Trace):
        _probe_sharded(copy, mesh, planned, unsharded=unsharded, sp=sp)
    return planned


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh, planned: TensorParallelPlan) -> None:
    """Shard ``model`` with a plan :func:`plan_tensor_parallel` checked; ties and frozen parameters survive."""
    split = _shard_keeping_ties(model, mesh, planned.styles)
    localize_head_counts(model, mesh.size(), split=split)
    choice = planned.choice
    log.info("Tensor parallel over %d ranks with the %s", mesh.size(), choice.source)
    log.info("The %s was chosen because %s", choice.source, choice.reason)
    if choice.unmatched:
        log.warning(
            "Tensor-parallel plan patterns that match no module of %s: %s", type(model).__name__, choice.unmatched
        )
    if choice.unsharded_weights:
        log.warning("Left whole on every tp rank (allow_unsharded_linears=True): %s", choice.unsharded_weights)
    if choice.kept_whole:
        log.info("Beside the language model, kept whole on every tp rank: %s", choice.kept_whole)
    if planned.replicated:
        log.info(
            "Replicated parameters computing on sharded activations (gradients summed over tp): %s", planned.replicated
        )
    if planned.head_counts:
        log.info("Head counts made this rank's: %s", planned.head_counts)


@contextmanager
def plan_not_logged() -> Iterator[None]:
    """Leave out of the log what :func:`apply_tensor_parallel` logs about the plan (its choice, patterns matching no
    module, weights left whole) in this thread, for a caller that reports it itself: the plan report, which
    parallelizes a model once a pipeline stage and once a checkpointing mode. Each use adds a filter of its own, so
    that a nested use leaves the outer one in place; other threads log as before."""
    caller = threading.get_ident()

    def from_another_thread(record: logging.LogRecord) -> bool:
        return threading.get_ident() != caller  # filters run in the thread that logs

    log.addFilter(from_another_thread)
    try:
        yield
    finally:
        log.removeFilter(from_another_thread)


def shard(model: nn.Module, mesh: DeviceMesh, styles: Mapping[str, ParallelStyle]) -> list[str]:
    """``parallelize_module`` pattern by pattern, module by module, so that a style that cannot shard a module is
    an error naming both. Returns the modules whose outputs are left split over tp (see
    :func:`~lightning_automodel.parallel.tensor.head_counts.splits_outputs`)."""
    modules, split = list(model.named_modules()), []
    for pattern, style in styles.items():
        for name, module in modules:
            if not pattern_matches(pattern, name):
                continue
            try:
                parallelize_module(module, mesh, style)
            except Exception as error:  # noqa: BLE001 - torch's styles raise several types, none naming the module
                raise ValueError(
                    f"{type(style).__name__} cannot shard {name} ({type(module).__name__}): {error}"
                ) from error
            if splits_outputs(style):
                split.append(name)
    return split


def _shard_keeping_ties(model: nn.Module, mesh: DeviceMesh, styles: Mapping[str, ParallelStyle]) -> list[str]:
    requires_grad = {name: p.requires_grad for name, p in model.named_parameters(remove_duplicate=False)}
    with ties_kept(model):
        split = shard(model, mesh, styles)
    # Some styles (SequenceParallel, replicated parameters) re-create parameters as trainable: restore what was frozen.
    for name, param in model.named_parameters(remove_duplicate=False):
        param.requires_grad_(requires_grad[name])
    return split


def _probe_sharded(copy: nn.Module, mesh: DeviceMesh, planned: TensorParallelPlan, *, unsharded: Trace, sp: bool):
    """Probe the sharded copy until no module computing on sharded activations is left plain; refuse what does not
    fit. Each round shards the modules found in the last (a replicated module can pass DTensors on to the next)."""
    tp, source = mesh.size(), planned.choice.source
    while True:
        try:
            sharded, failure = probe(copy, tokens=unsharded.tokens, images=unsharded.images), None
        except ProbeError as error:
            sharded, failure = error.trace, error
        running = failure.running if failure is not None else ()
        found = find_sharded_activations(copy, unsharded, sharded, tp=tp, failed_in=running)
        new = {name: style for name, style in found.styles.items() if name not in planned.styles}
        if new:
            _shard_keeping_ties(copy, mesh, new)
            planned.styles.update(new)
            planned.replicated += list(new)
            continue
        if found.unfixable:
            raise ValueError(_unfixable_message(copy, source, found.unfixable))
        if failure is not None:
            raise ValueError(_failure_message(copy, source, failure, sp=sp))
        if found.mismatches:
            raise ValueError(_mismatch_message(copy, source, found.mismatches, sp=sp))
        return


def _failure_message(model: nn.Module, source: str, failure: ProbeError, *, sp: bool) -> str:
    where = f"in {failure.module}" if failure.module else "in backward"
    broken = (
        f"The {source} breaks {type(model).__name__}: one step of the sharded model on the meta device fails {where}"
    )
    if sp and "mixed torch.Tensor and DTensor" in failure.detail:
        return (
            f"{broken} ({failure.detail}). With sp=True the residual stream is split along the sequence (a DTensor),"
            f" and {failure.module or 'the model'} combines it with a whole tensor (a state of its own, or the output"
            " of a layer the plan leaves whole): this model has no sequence-parallel layout here. Use sp=False."
        )
    return (
        f"{broken} ({failure.detail}). That module computes with sizes the plan"
        " splits (a count or width read in its code, a parameter per head or per hidden unit). Pass tp_plan= that"
        f" leaves {failure.module or 'it'} and the projections around it whole (with allow_unsharded_linears=True),"
        " or use tp=1."
    )


def _mismatch_message(model: nn.Module, source: str, mismatches: Sequence[LayoutMismatch], *, sp: bool) -> str:
    shown = "; ".join(str(m) for m in mismatches[:3]) + (
        f"; and {len(mismatches) - 3} more" if len(mismatches) > 3 else ""
    )
    hint = (
        " With sp=True the plan takes tensors for sequence shards where the model hands over the whole sequence (or"
        " the other way round): its sequence-parallel layout does not fit this model. Use sp=False, or pass tp_plan="
        " with sequence-parallel styles that fit."
        if sp
        else " Pass tp_plan= with styles that fit these modules, or use tp=1."
    )
    return f"The {source} does not fit {type(model).__name__}: {shown}.{hint}"


def _unfixable_message(model: nn.Module, source: str, names: Sequence[str]) -> str:
    owners = list(dict.fromkeys(name.rpartition(".")[0] for name in names))
    return (
        f"The {source} splits activations that {', '.join(names[:4])} of {type(model).__name__} compute on, inside"
        f" the code of {', '.join(owners[:4])}, which receives only whole tensors: each rank would compute part of"
        " their gradient, and no style of that module can sum it. Pass tp_plan= that leaves the projections of"
        f" {owners[0]} whole (with allow_unsharded_linears=True), or use tp=1."
    )
