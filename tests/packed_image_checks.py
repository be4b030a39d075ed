"""Image inputs packed across the batch (MiniCPM-V's, Molmo2's: lightning_automodel/hf/vision/packed_images.py) or of
any number of patches or views an image (Inkling's, DeepSeek-OCR 2's) inside gloo workers: a data-parallel rank whose
rows hold no image runs the tower on a stand-in image of the same layout, ranks whose images have other numbers of
views call the tower alike, and one step matches one process."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from transformers import AutoModelForImageTextToText

from lightning_automodel import parallelize
from lightning_automodel.hf.vision.image_inputs import image_inputs, image_token, model_pixels
from lightning_automodel.hf.vision.image_rows import BY_IMAGE, BY_ROW
from lightning_automodel.hf.vision.local_views import CROPS, LOCAL
from lightning_automodel.hf.vision.tiny import tiny_image_text_config
from lightning_automodel.parallel.mesh import data_mesh
from lightning_automodel.planning.replica_comparison import ZERO_GRADIENT
from lightning_automodel.testing.coverage_report.kinds import image_loss, image_rows, rows_part
from lightning_automodel.testing.parity import Outputs, dims_for, full, gradient_errors, relative_error

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


def check_views_differ_by_rank(model_type: str) -> dict[str, float]:
    """At dp_shard=2, rank 0's images come with a local crop each (the tower runs twice), rank 1's as global views
    alone (once): no collective goes unmatched, and the step matches one process."""
    reference = _tiny(model_type)
    pixels = model_pixels(reference, images=1)
    views = [pixels, {name: value for name, value in pixels.items() if name not in (LOCAL, CROPS)}]
    batches = [_view_rows(reference, views=each) for each in views]
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
