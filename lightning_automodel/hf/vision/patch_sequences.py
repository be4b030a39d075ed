"""Towers that take each image as a sequence of flattened patches rather than as an image
(:func:`~lightning_automodel.hf.vision.image_inputs.pixel_inputs` lays the builder's images out so):

* SigLIP2's NaFlex tower (LFM2-VL), whose model takes ``spatial_shapes``: ``pixel_values`` of (images, patches,
  channels x patch ** 2), each image's patch grid in ``spatial_shapes`` and its patches in ``pixel_attention_mask``;
  an image of ``NAFLEX_SIDE`` x ``NAFLEX_SIDE`` patches (the tower has no fixed image size), as many tokens as its
  ``downsample_factor`` x ``downsample_factor`` blocks;
* a tower of patches at given positions (Gemma 4), whose model takes ``image_position_ids``: ``pixel_values`` as
  NaFlex's, each patch's (x, y) in ``image_position_ids``; an image of 2 x 2 blocks of ``pooling_kernel_size`` a
  side, one token a block (Gemma 4 Unified's embedder takes each block whole, its ``model_patch_size`` a side);
* Kosmos-2.5's ``flattened_patches``: (images, patches, 2 + ``patch_embed_hidden_size``), each patch's row and
  column (from 1) before its pixels; an image of ``NAFLEX_SIDE`` x ``NAFLEX_SIDE`` patches;
* a model without a vision tower (Fuyu), whose config gives the image and patch sizes itself: ``pixel_values`` of
  (images, patches, channels x patch ** 2), one token a patch, which a linear layer embeds.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from lightning_automodel.hf.vision.beside_pixels import forward_arguments

NAFLEX_SIDE = 4  # patches a side of a NaFlex image: two 2 x 2 blocks a side
NAFLEX = "spatial_shapes"  # the forward argument of a NaFlex tower's model
POSITIONED = "image_position_ids"  # the forward argument of a model whose tower pools patches by position
FLATTENED = "flattened_patches"  # Kosmos-2.5's pixels, which its forward takes instead of pixel_values
PATCH_STREAM = "patch_stream"  # the layout of a model without a tower (Fuyu)
PIXELS = ("pixel_values", FLATTENED)  # what a forward may take an image's pixels as


def sequence_layout(model: nn.Module) -> str | None:
    """Which of this module's layouts ``model`` takes (:data:`NAFLEX`, :data:`POSITIONED`, :data:`PATCH_STREAM`),
    None for another."""
    config = model.config
    found = forward_arguments(model) & {NAFLEX, POSITIONED, FLATTENED}
    if found:
        return found.pop()
    if getattr(config, "vision_config", None) is None and _sizes(config) is not None:
        return PATCH_STREAM
    return None


def sequence_token_count(model: nn.Module) -> int | None:
    """Placeholders per image of a model of one of this module's layouts (None for another)."""
    layout = sequence_layout(model)
    if layout == FLATTENED:
        return None  # its placeholders are its resampler's queries (beside_pixels)
    if layout == NAFLEX:
        return (NAFLEX_SIDE // (getattr(model.config, "downsample_factor", None) or 1)) ** 2
    if layout == POSITIONED:
        return 4  # 2 x 2 pooled blocks
    if layout == PATCH_STREAM:
        image, patch = _sizes(model.config)
        return (image // patch) ** 2
    return None


def image_tower_config(config: Any) -> Any:
    """The config of the model's image tower: its vision tower's, else its VQ-GAN's (Chameleon reads an image as the
    tokens of its codes), else None."""
    return getattr(config, "vision_config", None) or getattr(config, "vq_config", None)


def tower_config(config: Any) -> Any:
    """The config holding the image's sizes: the vision tower's, or (Fuyu, no tower) the model's own."""
    vision = image_tower_config(config)
    return vision if vision is not None or _sizes(config) is None else config


def sequence_patch(vision: Any) -> int:
    """The side in pixels of a patch the tower embeds whole: Gemma 4 Unified's ``model_patch_size`` (a block of
    patches), the ``patch_size``, or that of ``patch_embed_hidden_size`` pixels of three channels (Kosmos-2.5)."""
    flat = getattr(vision, "patch_embed_hidden_size", None)
    found = getattr(vision, "model_patch_size", None) or getattr(vision, "patch_size", None)
    found = found or (math.isqrt(flat // 3) if isinstance(flat, int) else None)
    return found[0] if isinstance(found, list | tuple) else found


def image_side(vision: Any) -> int:
    """The side in pixels of the builder's images: the tower's image size (a VQ-GAN's resolution), else two codes of
    a VQ-GAN that halves the image at each level after the first (Emu3's), else two pooled blocks of patches, else
    NaFlex's ``NAFLEX_SIDE`` patches."""
    size = getattr(vision, "image_size", None) or getattr(vision, "resolution", None)
    size = size[0] if isinstance(size, list | tuple) else size
    pool = getattr(vision, "pooling_kernel_size", None)
    levels = getattr(vision, "channel_multiplier", None)
    if isinstance(size, int):
        return size
    if isinstance(levels, list | tuple):
        return 2 * 2 ** (len(levels) - 1)
    patch = getattr(vision, "patch_size", None) or sequence_patch(vision)
    return (2 * pool if isinstance(pool, int) else NAFLEX_SIDE) * patch


def as_patch_sequences(pixels: torch.Tensor, *, vision: Any, layout: str) -> dict[str, torch.Tensor]:
    """``pixels`` (images, channels, side, side) as inputs of ``layout`` for a tower of config ``vision``: each
    image's patches in rows, flattened channel by channel (as NaFlex's and Fuyu's processors flatten them)."""
    patch = sequence_patch(vision)
    images, channels, side, _ = pixels.shape
    per_side = side // patch
    if pixels.is_meta:
        patches = torch.empty(images, per_side * per_side, channels * patch * patch, device="meta")
    else:
        patches = pixels.unfold(2, patch, patch).unfold(3, patch, patch)  # (images, channels, rows, columns, p, p)
        patches = patches.permute(0, 2, 3, 4, 5, 1).reshape(images, per_side * per_side, -1)
    index = torch.arange(per_side * per_side)
    positions = torch.stack([index % per_side, index // per_side], -1).expand(images, -1, -1)  # (x, y), row by row
    if layout == PATCH_STREAM:
        return {"pixel_values": patches}
    if layout == POSITIONED:
        return {"pixel_values": patches, POSITIONED: positions.clone()}
    if layout == FLATTENED:  # (row, column) from 1, then the pixels
        return {FLATTENED: torch.cat([positions.flip(-1).to(patches) + 1, patches], -1)}
    return {
        "pixel_values": patches,
        "spatial_shapes": torch.tensor([[per_side, per_side]] * images),
        "pixel_attention_mask": torch.ones(images, per_side * per_side, dtype=torch.bool),
    }


def _sizes(config: Any) -> tuple[int, int] | None:
    image, patch = getattr(config, "image_size", None), getattr(config, "patch_size", None)
    return (image, patch) if isinstance(image, int) and isinstance(patch, int) else None
