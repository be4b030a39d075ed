"""Tensor parallel for the parts of a vision-language model beside its language model: the vision tower's blocks and
the projector, split by the derived plan's rule (entries column-, exits row-parallel) where the probe's step with
images runs them. The language model's plan is chosen as for a text model; this adds the tower's styles to it.

The tower's activations are not sequence-parallel: each rank holds the whole image sequence between blocks (a
row-parallel exit all-reduces into it), and what is kept whole (embeddings, norms, a projection no style fits)
computes the same whole gradient on every tp rank, which FSDP2 averages over the data-parallel ranks.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_automodel.hf.decoder_layers import multimodal_units, named_decoder_layers, named_multimodal_parts
from lightning_automodel.parallel.probe.step import Trace
from lightning_automodel.parallel.tensor.plans.derived import (
    entry_style,
    exit_styles,
    follow_projections,
    projections,
)
from lightning_automodel.parallel.tensor.plans.patterns import keyed_by_position, matches_inside
from lightning_automodel.parallel.tensor.plans.selection import PlanChoice

UNCLOSED = "no row-parallel projection of its block closes its split output"
NOT_RUN = "the probe's step with images never calls it (the code around it may read its weight)"
NO_PROJECTION = "it holds no projection (nn.Linear, Conv1D) a style splits"


def with_tower_plan(model: nn.Module, choice: PlanChoice, *, trace: Trace | None) -> PlanChoice:
    """``choice`` with styles for the tower's blocks and the projector where a derived plan fits them, and what is
    kept whole on every tp rank and why (:attr:`PlanChoice.kept_whole`). Nothing for a model without such parts."""
    parts = named_multimodal_parts(model)
    if not parts:
        return choice
    if trace is None or not trace.images:
        why = trace.images_failure if trace is not None and trace.images_failure else "it has no probe step"
        return kept_whole_for(model, choice, reason=f"no probe step ran the model's images ({why})")
    try:
        styles, kept = tower_styles(model, trace=trace)
    except ValueError as error:  # a step the derived plan's hooks cannot follow
        return kept_whole_for(model, choice, reason=str(error))
    styles = keyed_by_position(styles, names=[name for name, _ in model.named_modules()])
    return replace(choice, plan={**choice.plan, **styles}, kept_whole=kept)


def kept_whole_for(model: nn.Module, choice: PlanChoice, *, reason: str) -> PlanChoice:
    """``choice`` (the language model's plan) with every multimodal part kept whole on every tp rank for ``reason``:
    entries inside them are dropped (a Hugging Face plan may cover Gemma 4's tower, which no probe step then ran:
    its per-head norms would go without their gradients summed)."""
    parts = [name for name, _ in named_multimodal_parts(model)]
    names = [name for name, _ in model.named_modules()]
    plan = {key: style for key, style in choice.plan.items() if not matches_inside(key, parts, names=names)}
    return replace(choice, plan=plan, kept_whole=dict.fromkeys(parts, reason))


def tower_styles(model: nn.Module, *, trace: Trace) -> tuple[dict[str, ParallelStyle], dict[str, str]]:
    """Styles by module name for the projections of the multimodal parts' blocks and units that ``trace`` (a step
    with images) runs, and the projections left whole with the reason. An entry no style fits is kept whole and the
    step followed again without it (its exits become entries or whole in turn)."""
    modules = dict(model.named_modules())
    followed = [name for name in _followed(model) if trace.called(name)]
    refused: dict[str, str] = {}
    while True:
        flow = follow_projections(model, blocks=followed, images=True, whole=refused)
        styles: dict[str, ParallelStyle] = {}
        for name, uses in flow.entries.items():
            try:
                styles[name] = entry_style(name, modules[name], uses)
            except ValueError as error:
                refused[name] = str(error).split(":")[0]
        if len(styles) == len(flow.entries):
            break
    kept = {}
    for unit in _followed(model):
        found = projections(modules[unit], prefix=unit)
        if not found:
            kept[unit] = NO_PROJECTION
        for name, _ in found:
            if name not in styles and name not in flow.exits:
                kept[name] = refused.get(name, UNCLOSED if trace.called(name) else NOT_RUN)
    return {**styles, **exit_styles(model, flow)}, kept


def _followed(model: nn.Module) -> list[str]:
    """The multimodal parts' blocks and units (a projector, a merger), by name."""
    prefixes = tuple(f"{name}." for name, _ in named_multimodal_parts(model))
    names = {id(module): name for name, module in model.named_modules()}
    blocks = [name for name, _ in named_decoder_layers(model) if name.startswith(prefixes)]
    return blocks + [names[id(unit)] for unit in multimodal_units(model)]
