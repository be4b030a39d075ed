"""Image inputs a processor packs across the whole batch, rather than laying them out image by image along the first
dimension; each layout read off the forward's arguments:

* ``target_sizes`` (MiniCPM-V, MiniCPM-OCR): ``pixel_values`` of (1, channels, patch, patches x patch), every
  image's patches side by side along the last dimension, image after image (the model reads ``pixel_values[:1]``),
  and each image's patch grid in ``target_sizes`` (images, 2). An image's placeholders are its patches over the
  patches a token merges: the tower's window merge (``window_kernel_size``) unless ``downsample_mode`` is ``"4x"``,
  then the merger's ``merge_kernel_size``, ``merger_times`` times. The builder's image: one token's patches high, two
  wide (two placeholders).
* ``image_token_pooling`` (Molmo2): ``pixel_values`` of (crops, patches, channels x patch ** 2), every image's crops
  one after another; ``image_token_pooling`` (tokens, k): the patches each placeholder pools, as indices into the
  whole batch's flattened (crop, patch) sequence (-1 pads); ``image_grids`` (images, 4): the low- and high-resolution
  token grids (an image's placeholders: their sum); ``image_num_crops``. The builder's image: two crops of the
  tower's ``num_position_embeddings`` patches (its code adds one position a patch), each pooled into two tokens.

A set of rows takes its images' share of each (:mod:`~lightning_automodel.hf.vision.image_rows`), re-packed: the
pooling indices re-based on the crops it keeps.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from lightning_automodel.hf.vision.beside_pixels import forward_arguments
from lightning_automodel.hf.vision.patches import channel_count, random_pixels, side

PACKED = "target_sizes"
POOLED = "image_token_pooling"
POOLED_INPUTS = (POOLED, "image_grids", "image_num_crops")
_PACKED_TOKENS = (1, 2)  # the builder's MiniCPM-V image in tokens (height, width), each of a token's patches a side
_POOLED_GRID = (1, 2, 1, 2)  # the builder's Molmo2 image: a low-resolution crop of 1 x 2 tokens, a high-resolution one
_CROPS = 2


def packed_layout(model: nn.Module) -> str | None:
    """Which of this module's layouts ``model``'s forward takes (None for another)."""
    found = forward_arguments(model) & {PACKED, POOLED}
    return found.pop() if found else None


def images_layout(images: dict[str, Tensor]) -> str | None:
    """Which of this module's layouts a batch's image inputs ``images`` are in (None for another): read off the
    inputs, as a model whose forward a pipeline took over no longer says."""
    return next((layout for layout in (PACKED, POOLED) if layout in images), None)


def packed_token_count(model: nn.Module) -> int:
    """Placeholders of the builder's image of ``model`` (a model of one of this module's layouts)."""
    if packed_layout(model) == POOLED:
        return _POOLED_GRID[0] * _POOLED_GRID[1] + _POOLED_GRID[2] * _POOLED_GRID[3]
    return _PACKED_TOKENS[0] * _PACKED_TOKENS[1]


def packed_pixels(model: nn.Module, *, images: int, device: Any = "cpu") -> dict[str, Tensor]:
    """The builder's image inputs of ``images`` images for ``model``, packed as its layout says; pixels random
    (empty on the meta device) on ``device``, grids and indices on the CPU, where the model's code reads them."""
    vision = model.config.vision_config
    channels, patch = channel_count(vision), side(vision.patch_size)
    if packed_layout(model) == PACKED:
        token = patches_per_token_side(model.config)
        sizes = torch.tensor([[token * _PACKED_TOKENS[0], token * _PACKED_TOKENS[1]]] * images, dtype=torch.int32)
        return {
            "pixel_values": random_pixels((1, channels, patch, int(sizes.prod(-1).sum()) * patch), device=device),
            PACKED: sizes,
        }
    patches = getattr(vision, "num_position_embeddings", None) or (side(vision.image_size) // patch) ** 2
    crops = images * _CROPS
    return {
        "pixel_values": random_pixels((crops, patches, channels * patch * patch), device=device),
        POOLED: _halves(crops, patches),
        "image_grids": torch.tensor([_POOLED_GRID] * images),
        "image_num_crops": torch.full((images,), _CROPS),
    }


def _halves(crops: int, patches: int) -> Tensor:
    """Each crop's patches in two tokens' pools (the first holding one more), -1 padding the second."""
    width = math.ceil(patches / 2)
    pools = torch.full((crops, 2, width), -1)
    for crop in range(crops):
        first, second = torch.arange(crop * patches, (crop + 1) * patches).tensor_split((width,))
        pools[crop, 0], pools[crop, 1, : len(second)] = first, second
    return pools.view(crops * 2, width)


def patches_per_token_side(config: Any) -> int:
    """Patches a side that one placeholder's features merge, in a ``target_sizes`` model: the tower's window merge
    (unless ``downsample_mode`` is ``"4x"``), then the merger's kernel ``merger_times`` times."""
    window = 1 if getattr(config, "downsample_mode", None) == "4x" else side(config.vision_config.window_kernel_size)
    return window * side(config.merge_kernel_size) ** getattr(config, "merger_times", 1)


def packed_blocks(
    model: nn.Module, images: dict[str, Tensor]
) -> tuple[Tensor, dict[str, tuple[int, Tensor]], Tensor | None]:
    """Of a batch of ``model``'s images in one of this module's layouts: each image's placeholders; of each image
    input, the dimension images follow each other along and each image's extent there; and each image's extent of
    the (crop, patch) sequence the pooling indices point into (Molmo2; None for MiniCPM-V)."""
    pixels = images["pixel_values"]
    if images_layout(images) == PACKED:
        sizes = images[PACKED].cpu().long().prod(-1)
        tokens = sizes // patches_per_token_side(model.config) ** 2
        return tokens, {"pixel_values": (-1, sizes * pixels.shape[-2]), PACKED: (0, torch.ones_like(sizes))}, None
    grids, crops = images["image_grids"].cpu(), images["image_num_crops"].cpu()
    tokens = grids[:, :2].prod(-1) + grids[:, 2:].prod(-1)
    ones = torch.ones_like(tokens)
    blocks = {"pixel_values": (0, crops), POOLED: (0, tokens), "image_grids": (0, ones), "image_num_crops": (0, ones)}
    return tokens, blocks, crops * pixels.shape[1]
