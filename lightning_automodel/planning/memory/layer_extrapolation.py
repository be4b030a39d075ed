"""A figure of a model of many alike decoder layers, measured on a few of them and extrapolated.

Memory per rank grows with the layer count by the same bytes for each layer between the first and the last (these
differ: FSDP2 keeps the last gathered after forward, the loss follows it) when every layer is alike, once the layers
are more than a prefetch window. Measuring a model of 80 such layers on three, four and five of them takes the time of
twelve, which makes the plan's memory figures and ``plan --fit`` affordable on the models they are for. Linearity is
checked as far as it can be: where the two increments of the few-layer measurements differ, the counts slide by a
layer (:data:`SLIDES`), then the whole model is measured; where they agree, every further layer is taken to add the
same (it did, to the byte, on every model and
layout measured against the whole: ``tests/test_memory.py``, README).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable

from torch import nn

from lightning_automodel.hf.decoder_layers import named_decoder_layers
from lightning_automodel.hf.layer_fields import layers_alike
from lightning_automodel.hf.shrink import layers_kept

# The layer counts a model of many alike layers is measured with.
FEW_LAYERS = (3, 4, 5)
# Where their increments differ, the counts slide by one layer, at most this many times, before the whole model is
# measured: the first layers can still move the peak (the 70B example at pp=2 x tp=4, 1F1B over 16 micro-batches:
# 3 to 4 layers add 1.54 GB, each layer from 4 on 1.87 GB, the whole stage's 40 extrapolated from 4, 5 and 6 to the
# byte), and measuring 6 layers takes a tenth of the time of 40.
SLIDES = 2


def over_layers(measure: Callable[[nn.Module], int], model: nn.Module, *, few: tuple[int, ...] = FEW_LAYERS) -> int:
    """``measure(model)``; for a model of more than twice ``few[-1]`` alike decoder layers (:func:`alike_layers`),
    extrapolated from ``measure`` of copies cut to ``few`` layers (consecutive counts). ``measure`` may consume the
    model it is given (parallelize it), and so may this."""
    alike = alike_layers(model)
    if alike is None:
        return measure(model)

    def with_count(count: int) -> int:
        return measure(model if count == len(alike) else with_layers(copy.deepcopy(model), layers=count))

    return extrapolated(with_count, layers=len(alike), few=few)


def extrapolated(measure: Callable[[int], int], *, layers: int, few: tuple[int, ...] = FEW_LAYERS) -> int:
    """``measure(layers)``, a figure of ``layers`` alike layers; where they are more than twice ``few[-1]``,
    extrapolated from ``measure`` of ``few`` layers (consecutive counts) if it grows by the same with each."""
    if layers <= 2 * few[-1]:
        return measure(layers)
    known: dict[int, int] = {}
    for counts in slid(few, layers=layers):
        values = [known[count] if count in known else known.setdefault(count, measure(count)) for count in counts]
        increment = common_increment(values)
        if increment is not None:
            return values[-1] + (layers - counts[-1]) * increment
    return measure(layers)  # not yet linear: the whole model decides


def slid(few: tuple[int, ...], *, layers: int) -> list[tuple[int, ...]]:
    """``few`` and the counts it slides to (:data:`SLIDES`), each at most half of ``layers``."""
    return [tuple(count + shift for count in few) for shift in range(SLIDES + 1) if 2 * (few[-1] + shift) <= layers]


def common_increment(values: list[int]) -> int | None:
    """The one step between consecutive ``values``, or None where the steps differ."""
    increments = {later - earlier for earlier, later in itertools.pairwise(values)}
    return increments.pop() if len(increments) == 1 else None


def alike_layers(model: nn.Module) -> nn.ModuleList | None:
    """The list of ``model``'s decoder layers when it holds all of them and they are alike (the same parameters and
    attention type, the config's per-layer settings one for all); None otherwise."""
    config = getattr(model, "config", None)
    named = named_decoder_layers(model)
    lists = {name.rsplit(".", 1)[0] for name, _ in named}
    if config is None or len(lists) != 1:
        return None
    layers = model.get_submodule(lists.pop())
    text_config = config.get_text_config()
    alike = len({_structure(layer) for layer in layers}) == 1 and layers_alike(text_config.to_dict())
    whole = len(layers) == len(named) == getattr(text_config, "num_hidden_layers", len(layers))
    return layers if alike and whole else None


def _structure(layer: nn.Module) -> tuple:
    parameters = tuple((name, p.shape, p.dtype, p.requires_grad) for name, p in layer.named_parameters())
    return type(layer), parameters, getattr(layer, "attention_type", None)


def with_layers(model: nn.Module, *, layers: int) -> nn.Module:
    """``model`` (of alike layers) cut to its first ``layers`` decoder layers, its config's per-layer settings cut
    with them."""
    stack = alike_layers(model)
    if stack is None:
        raise ValueError(f"{type(model).__name__}'s decoder layers are not alike: it cannot be cut to a few of them.")
    del stack[layers:]
    config = model.config.get_text_config()
    for name, value in layers_kept(config.to_dict(), list(range(layers))).items():
        setattr(config, name, value)
    return model
