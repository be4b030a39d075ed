"""Choosing a model's tensor-parallel plan: the user's, else the first candidate that shards every decoder block, and
a refusal naming what each candidate lacks when none does."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_automodel.hf.decoder_layers import named_decoder_layers
from lightning_automodel.parallel.probe.step import Trace
from lightning_automodel.parallel.tensor.plans.completion import completed
from lightning_automodel.parallel.tensor.plans.derived import derived_plan
from lightning_automodel.parallel.tensor.plans.family import PlanFunction, TPPlan, family_plan, llama_plan
from lightning_automodel.parallel.tensor.plans.head_arguments import with_head_arguments
from lightning_automodel.parallel.tensor.plans.hf_plan import hf_style_strings, hf_tp_plan, translate_style
from lightning_automodel.parallel.tensor.plans.multi_query import with_multi_query
from lightning_automodel.parallel.tensor.plans.patterns import pattern_matches
from lightning_automodel.parallel.tensor.plans.sequence_parallel import with_sequence_parallel
from lightning_automodel.parallel.tensor.plans.sharded_weights import (
    ShardedWeights,
    sharded_weights,
    unmatched_patterns,
)

PlanSpec = Mapping[str, ParallelStyle | str] | str | PlanFunction


@dataclass
class PlanChoice:
    """The plan a model gets, where it came from, why it won, and what it leaves whole."""

    plan: TPPlan
    source: str  # "user plan", "family plan for X", "Hugging Face plan of X", "default Llama-style plan", "derived ..."
    reason: str
    unsharded_weights: list[str] = field(default_factory=list)  # large block weights left whole on every tp rank
    unmatched: list[str] = field(default_factory=list)  # patterns naming no module
    # Parts of a vision-language model, or their projections, kept whole on every tp rank: name -> why.
    kept_whole: dict[str, str] = field(default_factory=dict)


class _Verdict(NamedTuple):
    """A candidate plan (None: it could not be built) and what it covers."""

    source: str
    plan: TPPlan | None
    sharded: ShardedWeights


def select_tp_plan(
    model: nn.Module,
    *,
    sp: bool,
    tp_plan: PlanSpec | None = None,
    allow_unsharded_linears: bool = False,
    blocks: Sequence[tuple[str, nn.Module]] | None = None,
    trace: Trace | None = None,
) -> PlanChoice:
    """The plan for ``model``: the user's ``tp_plan`` if given, else the first of the family plan registered for its
    class, its own Hugging Face plan, the default Llama-style plan and the derived plan that shards every decoder
    block (candidates after the first that does are not built: deriving one runs a step on the meta device).

    ``blocks``: the decoder blocks a text-only step runs (by default every block, see
    :func:`~lightning_automodel.hf.decoder_layers.named_decoder_layers`). A plan that leaves a large weight of a block
    whole is refused unless ``allow_unsharded_linears``; then the candidate sharding the largest share of the blocks'
    weights wins. Raises a ValueError naming what each candidate lacks.

    ``trace``: a probe step of the model (see :mod:`~lightning_automodel.parallel.probe`), where known: the weights
    of modules it never calls (a decoder's cross-attention) need no sharding, and a candidate without a
    sequence-parallel layout of its own gets one with ``sp`` (see :mod:`.sequence_parallel`).
    """
    blocks = named_decoder_layers(model) if blocks is None else blocks
    called = trace.called if trace is not None else None
    if tp_plan is not None:
        plan = _resolve_user_plan(tp_plan, model, sp)
        user = _Verdict("user plan", plan, sharded_weights(model, plan, blocks, called=called))
        _refuse_if_incomplete(model, user, allow=allow_unsharded_linears)
        return _chosen_plan(model, user, reason="it was given (tp_plan=)")
    verdicts = _verdicts(model, sp=sp, blocks=blocks, trace=trace)
    complete = [verdict for verdict in verdicts if _shards_every_block(verdict.sharded)]
    if complete:
        reason = _reason_with_passed_over(complete[0], verdicts, because="it shards every decoder block")
        return _chosen_plan(model, complete[0], reason=reason)
    usable = [verdict for verdict in verdicts if verdict.sharded.unusable is None and verdict.sharded.matches_any]
    if allow_unsharded_linears and usable:
        best = max(usable, key=lambda verdict: verdict.sharded.sharded_share)  # the first of equals
        because = f"it shards the largest share of the decoder blocks' weights ({best.sharded.sharded_share:.0%})"
        return _chosen_plan(model, best, reason=_reason_with_passed_over(best, verdicts, because=because))
    raise ValueError(_no_plan_message(model, verdicts, allow=allow_unsharded_linears))


def _verdicts(
    model: nn.Module, *, sp: bool, blocks: Sequence[tuple[str, nn.Module]], trace: Trace | None
) -> list[_Verdict]:
    """The candidates' verdicts in order, up to the first that shards every decoder block; in each, multi-query
    attention's key/value head kept whole and arguments with an entry per head split with the heads."""
    called = trace.called if trace is not None else None
    verdicts: list[_Verdict] = []
    for source, build in _candidates(model, trace=trace):
        try:
            plan = with_head_arguments(model, with_multi_query(model, build(sp)), trace=trace)
        except ValueError as error:  # a Hugging Face plan with styles we cannot apply, or no sequence-parallel layout
            verdicts.append(_Verdict(source, None, ShardedWeights([], 0.0, unusable=str(error))))
            continue
        verdicts.append(_Verdict(source, plan, sharded_weights(model, plan, blocks, called=called)))
        if _shards_every_block(verdicts[-1].sharded):
            break
    return verdicts


def _candidates(model: nn.Module, *, trace: Trace | None) -> list[tuple[str, Callable[[bool], TPPlan]]]:
    name = type(model).__name__
    candidates = []
    family = family_plan(name)
    if family is not None:
        candidates.append((f"family plan for {name}", lambda sp: dict(family(model, sp))))
    if hf_style_strings(model):
        hf_source = f"Hugging Face plan of {name}"
        candidates.append(
            (hf_source, lambda sp: _completed_with_sp_layout(model, hf_tp_plan(model), sp=sp, trace=trace))
        )
    # The layout many decoder-only families share, under the names Llama gives it, for models whose blocks have them
    # (its sequence-parallel layout is written for those names).
    if _names_llama_blocks(model):
        candidates.append(("default Llama-style plan", lambda sp: completed(model, llama_plan(model, sp), sp=sp)))
    # Entries column-, exits row-parallel, found by following the data through the blocks, whatever their names.
    derived_source = f"derived plan (entries column-, exits row-parallel) for {name}"
    candidates.append(
        (derived_source, lambda sp: _completed_with_sp_layout(model, derived_plan(model), sp=sp, trace=trace))
    )
    return candidates


def _names_llama_blocks(model: nn.Module) -> bool:
    """Whether the Llama plan's patterns name a module of the decoder blocks."""
    names = [name for name, _ in model.named_modules()]
    return any(pattern_matches(p, name) for p in llama_plan(model, False) if ".layers.*." in p for name in names)


def _completed_with_sp_layout(model: nn.Module, plan: TPPlan, *, sp: bool, trace: Trace | None) -> TPPlan:
    """A plan that carries no sequence-parallel layout (a model's Hugging Face plan, a derived plan), completed; with
    ``sp``, with the layout derived for it."""
    plan = completed(model, plan, sp=sp)
    return with_sequence_parallel(model, plan, trace=trace) if sp else plan


def _import_object(path: str) -> object:
    module_name, _, attribute = path.rpartition(".")
    if not module_name:
        raise ValueError(f"tp_plan={path!r} is not an import path; write it as 'package.module.name'.")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"tp_plan={path!r} could not be imported: {error}") from error


def _resolve_user_plan(spec: PlanSpec, model: nn.Module, sp: bool) -> TPPlan:
    if isinstance(spec, str):
        spec = _import_object(spec)
    if callable(spec) and not isinstance(spec, Mapping):
        spec = spec(model, sp)
    if not isinstance(spec, Mapping):
        raise TypeError(
            f"tp_plan must be a dict of module pattern -> ParallelStyle, an import path to one, or a function"
            f" (model, sp) -> dict; got {type(spec).__name__}."
        )
    plan = {}
    for pattern, style in spec.items():
        style = translate_style(style, pattern, model=model) if isinstance(style, str) else style
        if style is not None:  # "replicate": nothing to shard
            plan[pattern] = style
    return plan


def _shards_every_block(found: ShardedWeights) -> bool:
    return found.unusable is None and found.matches_any and not found.unsharded


def _chosen_plan(model: nn.Module, verdict: _Verdict, *, reason: str) -> PlanChoice:
    unmatched = unmatched_patterns(model, verdict.plan)
    return PlanChoice(verdict.plan, verdict.source, reason, verdict.sharded.unsharded, unmatched)


def _reason_with_passed_over(chosen: _Verdict, verdicts: Sequence[_Verdict], *, because: str) -> str:
    """``because``, with what each candidate before ``chosen`` lacks."""
    before = [verdict.source for verdict in verdicts].index(chosen.source)
    passed_over = [f"the {source} {_shortcoming(found)}" for source, _, found in verdicts[:before]]
    return because + (f" ({'; '.join(passed_over)})" if passed_over else "")


def _shortcoming(found: ShardedWeights) -> str:
    if found.unusable is not None:
        return f"cannot be used: {found.unusable}"
    if not found.matches_any:
        return "matches no module"
    return f"leaves {_shortened_list(found.unsharded)} whole"


def _refuse_if_incomplete(model: nn.Module, verdict: _Verdict, *, allow: bool) -> None:
    source, plan, found = verdict
    if found.unusable is not None:
        raise ValueError(f"The {source} cannot be applied to {type(model).__name__}: {found.unusable}")
    if not found.matches_any:
        raise ValueError(
            f"The {source} matches no module of {type(model).__name__}: {sorted(plan)}. Pass tp_plan= with"
            " patterns over the names in model.named_modules()."
        )
    if found.unsharded and not allow:
        raise ValueError(
            f"The {source} leaves large weights of {type(model).__name__}'s decoder blocks unsharded:"
            f" {_shortened_list(found.unsharded)}. Every tp rank would hold and compute them in full. Add them to"
            " tp_plan=, or pass allow_unsharded_linears=True if that is intended."
        )


def _no_plan_message(model: nn.Module, verdicts: Sequence[_Verdict], *, allow: bool) -> str:
    name = type(model).__name__
    found = "; ".join(f"the {source} {_shortcoming(sharded)}" for source, _, sharded in verdicts)
    absent = [f"no family plan is registered for {name}"] if family_plan(name) is None else []
    absent += [f"{name} has no Hugging Face plan"] if not hf_style_strings(model) else []
    if allow:
        return (
            f"No tensor-parallel plan applies to {name}: {found}"
            + (f" ({'; '.join(absent)})" if absent else "")
            + ". Pass tp_plan= with styles for its modules (names as in model.named_modules()), or use tp=1."
        )
    return (
        f"No tensor-parallel plan shards every decoder block of {name}, so every tp rank would hold and compute them"
        f" whole: {found}" + (f" ({'; '.join(absent)})" if absent else "") + ". Pass tp_plan= with styles for those"
        " modules (names as in model.named_modules()), allow_unsharded_linears=True to train with them whole, or"
        " tp=1."
    )


def _shortened_list(names: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
