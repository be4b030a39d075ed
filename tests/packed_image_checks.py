"""Image inputs packed across the batch (MiniCPM-V's, Molmo2's: lightning_automodel/hf/vision/packed_images.py) or of
any number of patches or views an image (Inkling's, DeepSeek-OCR 2's) inside gloo workers: a data-parallel rank whose
rows hold no image runs the tower on a stand-in image of the same layout, ranks whose images have other numbers of
views call the tower alike, and one step matches one process; at cp, a row's packed images split over the ranks."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from transformers import AutoModelForImageTextToText

from lightning_automodel import ParallelDims, parallelize
from lightning_automodel.hf.vision.image_inputs import image_inputs, image_token, model_pixels
from lightning_automodel.hf.vision.image_rows import BY_IMAGE, BY_ROW
from lightning_automodel.hf.vision.local_views import CROPS, LOCAL
from lightning_automodel.hf.vision.tiny import SPECIAL_IDS_FROM, special_token_ids, tiny_image_text_config
from lightning_automodel.parallel.context_parallel import context_parallel_model, context_parallel_of, token_indices
from lightning_automodel.parallel.mesh import data_mesh
from lightning_automodel.planning.replica_comparison import ZERO_GRADIENT
from lightning_automodel.testing.coverage_report.kinds import image_loss, image_rows, rows_part
from lightning_automodel.testing.parity import FP32_TOLERANCE, Outputs, dims_for, full, gradient_errors, relative_error

# The gradients' allowance: fp32 reduction order, MiniCPM-V's linear-attention decay parameters loosest (the coverage
# report loosens them to 4e-5 from their fp32 rounding).
TOLERANCE = 1e-4


def check_packed_imageless_rank(model_type: str) -> dict[str, float]:
    """At dp_shard=2, rank 0 reads two rows holding an image each, rank 1 the same rows as text alone: no rank
    hangs, and the step matches one process whose loss is the mean of the two batches'."""
    reference = _tiny(model_type)
    rows = image_rows(reference)
    text = _text_alone(rows_part(rows, slice(2, 4), model=reference), placeholder=image_token(reference.config))
    batches = [rows_part(rows, slice(0, 2), model=reference), text]
    return _each_rank_its_batch(model_type, reference, batches)


def _each_rank_its_batch(model_type: str, reference: torch.nn.Module, batches: list[dict]) -> dict[str, float]:
    """dp_shard=2 under ``parallelize``, each rank stepping its own of ``batches``: the loss and every gradient against
    ``reference`` stepping the mean of both batches' losses."""
    losses = [image_loss(reference, batch)[0] for batch in batches]
    (sum(losses) / 2).backward()
    expected = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    mesh = dims_for(dist.get_world_size(), 1).build_mesh("cpu")
    model = _tiny(model_type)
    parallelize(model, mesh)
    loss, _ = image_loss(model, batches[data_mesh(mesh).get_local_rank()])
    loss.backward()
    dist.all_reduce(reduced := loss.detach().clone())
    grads = {name: full(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    errors = gradient_errors(Outputs(loss, loss, grads), Outputs(loss, loss, expected), floor=ZERO_GRADIENT)
    found = {"loss": relative_error(reduced / 2, sum(losses).detach() / 2), "grad": max(errors.values())}
    assert max(found.values()) < TOLERANCE, (found, max(errors, key=errors.get))
    return found


def _tiny(model_type: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(copy.deepcopy(tiny_image_text_config(model_type)))


def _text_alone(rows: dict[str, torch.Tensor], *, placeholder: int) -> dict[str, torch.Tensor]:
    """The rows without their images: each placeholder another token, no image inputs, no image token types."""
    text = {name: value for name, value in rows.items() if name not in BY_IMAGE}
    text["input_ids"] = torch.where(rows["input_ids"] == placeholder, 1, rows["input_ids"])
    return {name: torch.zeros_like(value) if name in BY_ROW else value for name, value in text.items()}


def check_packed_rows_split_over_cp(model_type: str, *, fsdp: bool = False) -> dict[str, float]:
    """At cp = world size, rows of two images each, the second's placeholders in the other rank's chunk (a row's
    image tokens seeing each other both ways across the ranks): the loss, each rank's logits and every gradient
    against one process, each rank's tower encoding its share of the images re-packed. ``fsdp``: under
    ``parallelize``, one image in the batch: the rank whose share is empty encodes it as its stand-in."""
    cp = dist.get_world_size()
    mesh = ParallelDims(cp=cp).resolve(cp).build_mesh("cpu")
    model, reference = _tiny(model_type), _tiny(model_type)
    inputs = _rows_of_images(reference, rows=1 if fsdp else 2, images_per_row=1 if fsdp else 2)
    labels = inputs["input_ids"].masked_fill(inputs["input_ids"] == image_token(reference.config), -100)
    if fsdp:
        parallelize(model, mesh)
    context = context_parallel_of(model) if fsdp else context_parallel_model(model, mesh)
    outputs, expected = _cp_outputs(model, inputs, labels), _cp_outputs(reference, inputs, labels)
    dist.all_reduce(outputs.loss)
    if not fsdp:  # each rank's share of the gradient, as FSDP's reduction over cp sums
        for grad in outputs.grads.values():
            dist.all_reduce(grad)
    scale = 1 if fsdp else cp
    outputs = Outputs(outputs.loss / cp, outputs.logits, {name: g / scale for name, g in outputs.grads.items()})
    held = token_indices(context.padded_length(labels.size(1)), cp, context.rank)
    real = held < labels.size(1)
    found = {
        "loss": relative_error(outputs.loss, expected.loss),
        "logits": relative_error(full(outputs.logits)[:, real], expected.logits[:, held[real]]),
        "grad": max(gradient_errors(outputs, expected, floor=ZERO_GRADIENT).values()),
    }
    assert max(found.values()) < FP32_TOLERANCE, found
    return found


def _rows_of_images(model: torch.nn.Module, *, rows: int, images_per_row: int) -> dict[str, torch.Tensor]:
    """The model's inputs for ``rows`` rows of 24 random text tokens holding ``images_per_row`` images each."""
    text = torch.randint(1, SPECIAL_IDS_FROM, (rows, 24), generator=torch.Generator().manual_seed(1))
    for special in special_token_ids(model.config):
        text[text == special] = 1 if special != 1 else 3
    return image_inputs(model, rows=rows, tokens=24, images_per_row=images_per_row, text=text)


def _cp_outputs(model: torch.nn.Module, inputs: dict[str, torch.Tensor], labels: torch.Tensor) -> Outputs:
    output = model(**inputs, labels=labels, use_cache=False)
    output.loss.backward()
    grads = {name: full(param.grad).clone() for name, param in model.named_parameters() if param.grad is not None}
    return Outputs(full(output.loss).detach().clone(), output.logits.detach(), grads)


def check_views_differ_by_rank(model_type: str) -> dict[str, float]:
    """At dp_shard=2, rank 0's images come with a local crop each (the tower runs twice), rank 1's as global views
    alone (once): no collective goes unmatched, and the step matches one process."""
    reference = _tiny(model_type)
    pixels = model_pixels(reference, images=1)
    views = [pixels, {name: value for name, value in pixels.items() if name not in (LOCAL, CROPS)}]
    batches = [_view_rows(reference, views=each) for each in views]
    return _each_rank_its_batch(model_type, reference, batches)


def _view_rows(model: torch.nn.Module, *, views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Two rows holding an image each, of the image inputs ``views`` gives one image (a global view, and crops or
    none), as many placeholders as the model makes features of them."""
    with torch.no_grad():
        count = len(model.get_image_features(**views).pooler_output[0])
    inputs = image_inputs(model, rows=2, tokens=count + 4, count=count)
    inputs = {name: value for name, value in inputs.items() if name not in (LOCAL, CROPS)}
    inputs.update({name: torch.cat([value, value]) for name, value in views.items()})
    labels = torch.where(inputs["input_ids"] == image_token(model.config), -100, 5)
    return {**inputs, "labels": labels}
