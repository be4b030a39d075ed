"""Images seen whole and in local crops, read off the forward's arguments (DeepSeek-OCR 2, Step3p7): a forward
taking ``pixel_values_local`` and ``num_local_patches`` takes, beside each image's global view in ``pixel_values``
(images, channels, size, size), the crops of all the batch's images one after another in ``pixel_values_local``
(crops, channels, size, size), each image's count in ``num_local_patches`` (0 for an image too small to crop), and,
where it takes ``patches_grid``, each image's crops as (columns, rows).

An image's placeholders are its views' learned queries (and a separator, or newlines), a count the model's code
fixes, not its config: the builder measures it
(:func:`~lightning_automodel.hf.vision.image_inputs.measured_token_count`). The builder's image: its global view and
``LOCAL_CROPS`` crop, each of the tower's image size. A set of rows finds its images by their runs of placeholders
(:func:`view_placeholders`; :mod:`~lightning_automodel.hf.vision.image_rows`).
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

from lightning_automodel.hf.vision.beside_pixels import forward_arguments
from lightning_automodel.hf.vision.patches import random_pixels

LOCAL = "pixel_values_local"
CROPS = "num_local_patches"
CROP_GRID = "patches_grid"
LOCAL_CROPS = 1  # crops an image of the builder


def takes_local_views(model: nn.Module) -> bool:
    """Whether ``model``'s forward takes images in global and local views (this module's layout), the crops' counts
    as a tensor (Unlimited-OCR's takes a list, which a batch of tensors does not carry: its images are global views
    alone)."""
    if not {LOCAL, CROPS} <= forward_arguments(model):
        return False
    return "Tensor" in str(inspect.signature(model.forward).parameters[CROPS].annotation)


def local_views(model: nn.Module, pixels: Tensor) -> dict[str, Tensor]:
    """The local views of the images whose global views are ``pixels``: ``LOCAL_CROPS`` crops each, of the global
    view's size (random, on its device), their counts and, where the forward takes it, their grid."""
    images = len(pixels)
    crops = {
        LOCAL: random_pixels((images * LOCAL_CROPS, *pixels.shape[1:]), device=pixels.device),
        CROPS: torch.full((images,), LOCAL_CROPS),
    }
    if CROP_GRID in forward_arguments(model):
        crops[CROP_GRID] = torch.tensor([[LOCAL_CROPS, 1]] * images)
    return crops


def view_placeholders(input_ids: Tensor, *, token: int, crops: Tensor) -> Tensor:
    """Each image's placeholders in ``input_ids`` (rows, tokens), image after image, from the runs of ``token``: one
    run an image (DeepSeek-OCR 2's processor), or one a view, an image's crops then its global view (Step3p7's marks
    each view's start and end); ``crops``: each image's count. Raises a ValueError where the runs are neither."""
    marked = torch.nn.functional.pad((input_ids == token).long().cpu(), (1, 1))
    edges = marked.diff(dim=1)
    runs = (edges == -1).nonzero()[:, 1] - (edges == 1).nonzero()[:, 1]
    crops = crops.cpu().long()
    if len(runs) == len(crops):
        return runs
    if len(runs) == len(crops) + int(crops.sum()):
        image = torch.repeat_interleave(torch.arange(len(crops)), crops + 1)
        return torch.zeros(len(crops), dtype=torch.long).index_add_(0, image, runs)
    raise ValueError(
        f"the batch's image placeholders lie in {len(runs)} runs, and its {len(crops)} images have"
        f" {int(crops.sum())} crops (num_local_patches): give each image's placeholders in one run, or one run a view"
        " (its crops', then its global view's), with a text token between images."
    )
