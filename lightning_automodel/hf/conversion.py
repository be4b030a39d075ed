"""How a model's tensors are stored in Hugging Face checkpoints: transformers' conversion mapping, read per tensor.

Most tensors are stored as they are, under their name or a renamed one. transformers 5 keeps a mixture-of-experts
layer's experts fused (``experts.gate_up_proj`` [experts, 2 x intermediate, hidden]) while many checkpoints store one
tensor per expert and projection (``experts.3.gate_proj.weight``): its loader stacks them over the experts
(``MergeModulelist``) and joins gate and up (``Concatenate``), and its ``save_pretrained`` splits them again.

Loading shard by shard reads only the experts a rank holds: the stored tensors of experts ``first`` to ``last`` go
through the same operations, which act on each expert alone, giving those experts' rows of the fused tensor. Other
merges (Kimi's and OLMo hybrid's convolution over [q; k; v], stored as three) read every stored tensor whole and
merge them as transformers does. A conversion splitting one stored tensor into several is refused by name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_automodel.hf.initialization import unsharded_view


@dataclass(frozen=True)
class Stored:
    """How one model tensor is stored: under ``names`` (one name, or several in transformers' order: one per expert
    and projection where ``per_expert``), merged by ``converter`` (transformers' ``WeightConverter``) when there are
    several."""

    names: tuple[str, ...]
    converter: Any = None
    per_expert: bool = False

    @property
    def is_merged(self) -> bool:
        return self.converter is not None


def stored_as(model: nn.Module, shapes: dict[str, torch.Size]) -> dict[str, Stored]:
    """For each tensor of ``model`` named in ``shapes`` (model state-dict names), how checkpoints store it.

    Raises a ValueError naming the tensor for a conversion that is not a merge of stored tensors.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, revert_weight_conversion

    view = unsharded_view(model)  # transformers looks the mapping up by class
    converters = [c for c in get_model_conversion_mapping(view, add_legacy=False) if isinstance(c, WeightConverter)]
    layout: dict[str, Stored] = {}
    for name, shape in shapes.items():
        try:
            names = tuple(revert_weight_conversion(view, {name: torch.empty(shape, device="meta")}))
        except Exception as error:  # noqa: BLE001 - transformers' conversion code, on a shape it does not expect
            raise ValueError(_unreadable(view, f"store {name} by a conversion that fails on it ({error})")) from error
        if len(names) == 1:  # renamed, or converted on its own (found by its stored name: Inkling 2's interleaving)
            converter = next((c for c in converters if any(_matches(p, names[0]) for p in c.source_patterns)), None)
        else:
            converter = next((c for c in converters if any(_matches(p, name) for p in c.target_patterns)), None)
        if len(names) == 1 and not getattr(converter, "operations", None):
            layout[name] = Stored(names)
            continue
        if converter is None or not (_acts_per_expert(converter) or _reshuffles(converter)):
            operations = getattr(converter, "operations", "an unknown conversion")
            raise ValueError(_unreadable(view, f"store {name} converted ({list(names)[:4]}...: {operations})"))
        layout[name] = Stored(names, converter, per_expert=_acts_per_expert(converter))
    stored = [n for entry in layout.values() for n in entry.names]
    if len(stored) != len(set(stored)):
        repeated = sorted({n for n in stored if stored.count(n) > 1})
        what = f"store several tensors under the same names {repeated[:4]} (split on load)"
        raise ValueError(_unreadable(view, what))
    return layout


def _unreadable(view: nn.Module, what: str) -> str:
    return (
        f"{type(view).__name__}'s checkpoints {what}, which loading shard by shard does not do. Build this model with"
        " transformers' own from_pretrained instead (its real weights are then broadcast from rank 0 and sharded)."
    )


def _reshuffles(converter: Any) -> bool:
    """Stored tensors joined as they are (Kimi's convolutions over q, k and v): their values pass unchanged, so the
    operations may run on tensors already cast to the model's dtype."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    return len(converter.operations) > 0 and all(
        isinstance(op, Concatenate | MergeModulelist) for op in converter.operations
    )


def _acts_per_expert(converter: Any) -> bool:
    """Stacking over the experts (dim 0), then joining on a dim after it: each expert's rows come from its own
    stored tensors."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    operations = converter.operations
    stacks = isinstance(operations[0], MergeModulelist) and operations[0].dim == 0
    return stacks and all(isinstance(op, Concatenate) and op.dim >= 1 for op in operations[1:])


def _matches(pattern: str, name: str) -> re.Match | None:
    """transformers' patterns are regular expressions with ``*`` for any text (here an index, captured), matching
    whole name components (``gate_up_proj`` is not ``gate_up_proj_bias``, ``experts.down_proj`` not
    ``shared_experts.down_proj``)."""
    start = r"(?<!\w)" if re.match(r"\w", pattern) else ""  # ".experts..." patterns start at a dot already
    return re.search(start + pattern.replace("*", r"(\d+)") + r"(?!\w)", name)


def experts_of(stored: Stored, *, first: int, last: int) -> list[str]:
    """The stored names holding experts ``first`` to ``last - 1`` of a merged tensor."""
    return [name for name in stored.names if first <= _expert_index(stored, name) < last]


def merged(stored: Stored, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model tensor (or, per expert, the fused rows of the experts whose stored ``tensors``, names from
    :func:`experts_of`, are given) merged from its stored tensors by transformers' own operations, in expert order."""
    from transformers.core_model_loading import dot_natural_key

    converter = stored.converter
    inputs: dict[str, Any] = {}
    for pattern in converter.source_patterns:
        found = sorted((n for n in tensors if _matches(pattern, n)), key=dot_natural_key)  # transformers' order
        inputs[pattern] = [tensors[n] for n in found]
    for operation in converter.operations:
        inputs = operation.convert(
            inputs, source_patterns=converter.source_patterns, target_patterns=converter.target_patterns
        )
    (whole,) = inputs.values()
    return whole


def _expert_index(stored: Stored, name: str) -> int:
    match = next(m for p in stored.converter.source_patterns if (m := _matches(p, name)))
    return int(match.group(1))


def split_as_stored(model: nn.Module, name: str, whole: torch.Tensor, stored: Stored) -> dict[str, torch.Tensor]:
    """The tensors ``save_pretrained`` writes for the model tensor ``name`` (whole): itself under its stored name,
    or for merged experts each expert's projections, by transformers' own reverse conversion."""
    if not stored.is_merged:
        return {stored.names[0]: whole}
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(unsharded_view(model), {name: whole}))
