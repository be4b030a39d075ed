"""The kinds of model the coverage report checks, each a registry of transformers: what a check builds (the Auto
class, a tiny config by name) and what it feeds (a batch of rows, its loss). Text causal LMs read token ids; an
image-text-to-text model reads rows holding an image each, in its own image inputs
(:mod:`lightning_automodel.hf.vision.image_inputs`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from lightning_automodel.hf.shrink import VOCAB
from lightning_automodel.hf.vision.beside_pixels import prefix_logits
from lightning_automodel.hf.vision.image_inputs import (
    IMAGE_START,
    image_inputs,
    image_token_count,
    measured_token_count,
)
from lightning_automodel.hf.vision.image_rows import BY_IMAGE, splits_by_image
from lightning_automodel.hf.vision.image_rows import image_rows as images_by_row
from lightning_automodel.hf.vision.patch_sequences import PIXELS
from lightning_automodel.hf.vision.tiny import SPECIAL_IDS_FROM, special_token_ids, tiny_image_text_config
from lightning_automodel.planning.replica_comparison import SEQ_LEN, token_batch
from lightning_automodel.planning.replica_comparison import loss_and_logits as text_loss_and_logits
from lightning_automodel.testing.coverage_report.model_types import coverage_config
from lightning_automodel.testing.parity import FP32_TOLERANCE

Rows = dict[str, torch.Tensor]  # a batch, every tensor laid out by rows (an image's patches a row's), labels too
BATCH_SIZE = 4


class NoImageInputs(Exception):
    """The image-input builder knows no inputs of this model: our limit, reported as such."""


@dataclass(frozen=True)
class Kind:
    """A registry the coverage report checks: how a type is built tiny and fed one batch."""

    name: str
    auto_class: Any
    config: Callable[[str], Any]
    rows: Callable[[nn.Module], Rows]  # the batch, from the single-process model (the same on every rank)
    loss_and_logits: Callable[[nn.Module, Rows], tuple[torch.Tensor, torch.Tensor]]


def text_rows(model: nn.Module) -> Rows:
    tokens, labels = token_batch(VOCAB, batch_size=BATCH_SIZE)
    return {"input_ids": tokens, "labels": labels}


def text_loss(model: nn.Module, rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
    return text_loss_and_logits(model, rows["input_ids"], rows["labels"])


def image_rows(model: nn.Module, *, seed: int = 1) -> Rows:
    """Rows of random text with an image each after the first token, its placeholders as many as the model makes
    features of one image (measured; else as its config says), never predicted (label -100), the last two tokens
    padding; the text avoids every special token id of the config."""
    try:
        count = measured_token_count(model) or image_token_count(model)
    except AttributeError as error:  # a config field the builder reads and this config lacks (image_size)
        raise NoImageInputs(f"{type(model).__name__}: {error}") from error
    if count is None:
        raise NoImageInputs(f"{type(model).__name__}: no image placeholder and pixel sizes in its config")
    length = IMAGE_START + count + SEQ_LEN
    length += length % 2  # a sequence tp=2 + sp splits evenly
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, SPECIAL_IDS_FROM, (BATCH_SIZE, length + 1), generator=generator)
    for special in special_token_ids(model.config):
        tokens[tokens == special] = 1 if special != 1 else 3
    labels = tokens[:, 1:].clone()
    labels[:, : IMAGE_START + count - 1] = -100  # those predicting a placeholder
    labels[:, -2:] = -100
    tokens[:, -2:] = 0
    try:
        inputs = image_inputs(model, rows=BATCH_SIZE, tokens=length, count=count, text=tokens[:, :-1])
    except ValueError as error:  # it names the model
        raise NoImageInputs(str(error)) from error
    except AttributeError as error:
        raise NoImageInputs(f"{type(model).__name__}: {error}") from error
    _assert_features_inputs_built(model, inputs)
    rows = {**inputs, "labels": labels}
    own = _own_positions(model, rows)
    rows = rows if own is None else {**rows, "position_ids": own}
    _assert_rows_apart(model, rows)
    return rows


def _assert_features_inputs_built(model: nn.Module, inputs: Rows) -> None:
    """The image arguments the model's ``get_image_features`` requires (no default) are all built: name those the
    builder does not make, rather than let the model fail on their absence."""
    get_features = getattr(model, "get_image_features", None)
    if get_features is None:
        return
    required = [
        name
        for name, parameter in inspect.signature(get_features).parameters.items()
        if parameter.default is inspect.Parameter.empty and parameter.kind is parameter.POSITIONAL_OR_KEYWORD
    ]
    missing = [name for name in required if name not in inputs and name != "self"]
    if missing:
        raise NoImageInputs(
            f"{type(model).__name__}: its get_image_features requires {', '.join(missing)}, which the image-input"
            " builder does not make"
        )


def _assert_rows_apart(model: nn.Module, rows: Rows) -> None:
    """Each half of the batch alone gives the logits it gives in the whole batch, as a data-parallel rank's rows
    must; where not, the inputs do not fit the model (images read out of order, placeholders it counts otherwise).
    A model whose step does not change with the pixels reads none of the images built, and is not measured."""
    if not _pixels_reach_the_step(model, rows):
        raise NoImageInputs(
            f"{type(model).__name__}: its logits and gradients do not change with the pixels built for it"
        )
    with torch.no_grad():
        _, whole = image_loss(model, rows)
        for half in (slice(0, BATCH_SIZE // 2), slice(BATCH_SIZE // 2, BATCH_SIZE)):
            _, alone = image_loss(model, rows_part(rows, half, model=model))
            error = ((alone - whole[half]).abs().max() / whole.abs().max()).item()
            if not error < FP32_TOLERANCE:
                raise NoImageInputs(
                    f"rows {half.start}-{half.stop - 1} alone give other logits than in the whole batch (relative"
                    f" error {error:.1e}): the image inputs built do not fit the model"
                )


def _own_positions(model: nn.Module, rows: Rows) -> torch.Tensor | None:
    """Each row's multimodal rotary positions, ``(axes, rows, tokens)``, found by the model's own ``get_rope_index``
    on the row alone, where they differ from those it finds for the whole batch (HunYuan-VL numbers images across
    the batch): a row's positions as a per-sample collator gives them, so that rows stand apart. None otherwise."""
    whole = _rope_positions(model, rows)
    if whole is None:
        return None
    alone = [_rope_positions(model, rows_part(rows, slice(row, row + 1), model=model)) for row in range(BATCH_SIZE)]
    alone = torch.cat(alone, 1)
    return None if torch.equal(alone, whole) else alone


def _rope_positions(model: nn.Module, rows: Rows) -> torch.Tensor | None:
    rope_index = getattr(model.base_model, "get_rope_index", None)
    if rope_index is None:
        return None
    taken = inspect.signature(rope_index).parameters
    given = {**rows, "attention_mask": (rows["input_ids"] != 0).long()}
    try:
        return rope_index(**{name: value for name, value in given.items() if name in taken})[0]
    except Exception:  # noqa: BLE001 - a rope index this call does not fit: the model's forward finds them
        return None


def _pixels_reach_the_step(model: nn.Module, rows: Rows) -> bool:
    """Whether other pixels give other logits, or else other gradients (Gemma 3's projector, initialised at zero,
    passes features of zero, and its weight's gradient reads the images)."""
    pixels = next(name for name in PIXELS if name in rows)
    other = {**rows, pixels: rows[pixels] + 1}
    with torch.no_grad():
        if not torch.equal(image_loss(model, rows)[1], image_loss(model, other)[1]):
            return True
    trained = [p for p in model.parameters() if p.requires_grad]
    grads = [torch.autograd.grad(image_loss(model, batch)[0], trained, allow_unused=True) for batch in (rows, other)]
    return any(
        (a is None) != (b is None) or (a is not None and not torch.equal(a, b)) for a, b in zip(*grads, strict=True)
    )


def image_loss(model: nn.Module, rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy in fp32 over the text, with a padding mask, and the text's logits (without those of
    an image's tokens the model put before it)."""
    inputs = {name: value for name, value in rows.items() if name != "labels"}
    if "use_cache" in inspect.signature(model.forward).parameters:
        inputs["use_cache"] = False
    logits = model(**inputs, attention_mask=(rows["input_ids"] != 0).long()).logits.float()
    logits = prefix_logits(logits, tokens=rows["input_ids"].shape[1])
    return F.cross_entropy(logits.flatten(0, 1), rows["labels"].flatten()), logits


def text_alone_error(model: nn.Module) -> BaseException | None:
    """What the model raises on text alone (no image, no placeholder), None where that runs: a model that fails on
    the image inputs built for it and on text alone is transformers' own failure, not the input builder's."""
    tokens, labels = token_batch(SPECIAL_IDS_FROM, batch_size=BATCH_SIZE)
    accepted = inspect.signature(model.forward).parameters
    types = {name: torch.zeros_like(tokens) for name in ("token_type_ids", "mm_token_type_ids") if name in accepted}
    try:
        with torch.no_grad():
            image_loss(model, {"input_ids": tokens, **types, "labels": labels})
    except Exception as error:  # noqa: BLE001 - the error is the answer
        return error
    return None


def rows_part(rows: Rows, part: slice, *, model: nn.Module) -> Rows:
    """The rows ``part`` of a batch: of each tensor, its rows, or its blocks of as many entries a row (Qwen2-VL's
    flattened patches, one image's a row); of image inputs packed across the batch (MiniCPM-V's, Molmo2's), of
    crops or patches of any number an image (DeepSeek-OCR 2's, Inkling's), the rows' images
    (:mod:`lightning_automodel.hf.vision.image_rows`)."""
    total = len(rows["input_ids"])
    taken, images = {}, {}
    if splits_by_image(model):
        images = {name: rows[name] for name in BY_IMAGE if name in rows}
        found = images_by_row(model, rows["input_ids"], images=images, tokens_per_image=0)
        taken = found.of_rows(torch.arange(total)[part])
    for name, value in rows.items():
        if name in images:
            continue
        if name == "position_ids" and value.dim() == 3:  # (axes, rows, tokens)
            taken[name] = value[:, part]
            continue
        per_row = value.shape[0] // total
        taken[name] = value[part.start * per_row : part.stop * per_row]
    return taken


TEXT = Kind("text", AutoModelForCausalLM, coverage_config, text_rows, text_loss)
IMAGE_TEXT = Kind("image-text-to-text", AutoModelForImageTextToText, tiny_image_text_config, image_rows, image_loss)
KINDS = {kind.name: kind for kind in (TEXT, IMAGE_TEXT)}
