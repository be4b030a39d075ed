"""Image inputs of towers that read an image as tiles padded to a fixed count, beside the generic layouts of
:mod:`~lightning_automodel.hf.vision.image_inputs`: the tiles a processor pads every image to, the mask of the real
ones, and, for a language model that reads images by cross-attention (Mllama), the mask of the text tokens that see
each image's tiles.

Each image is one real tile (its aspect ratio 1:1), as a processor tiles an image no larger than a tile.
"""

from __future__ import annotations

from typing import Any

import torch

# Mllama's aspect ratio id of one tile (1:1): ids count from 1 over the config's supported ratios, 0 is padding.
ONE_TILE_RATIO = 1


def padded_tiles(vision: Any, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mllama's layout of ``pixels`` (images, channels, size, size): (images, 1, ``max_num_tiles``, ...), the first
    tile the image and the rest zero padding, with the aspect ratio of one tile and the mask of the real tile."""
    tiles = tile_count(vision)
    padded = torch.zeros(len(pixels), 1, tiles, *pixels.shape[1:], device=pixels.device, dtype=pixels.dtype)
    padded[:, 0, 0] = pixels
    real = torch.zeros(len(pixels), 1, tiles, dtype=torch.long)
    real[:, :, 0] = 1
    return {
        "pixel_values": padded,
        "aspect_ratio_ids": torch.full((len(pixels), 1), ONE_TILE_RATIO, dtype=torch.long),
        "aspect_ratio_mask": real,
    }


def cross_attention_mask(input_ids: torch.Tensor, *, image_token: int, tiles: int) -> torch.Tensor:
    """Which tokens of each row see the row's image, and which of its ``tiles`` tiles: ``(rows, tokens, 1, tiles)``,
    1 from the image's token to the row's end on the real (first) tile, as Mllama's processor marks them (the tokens
    before the image see none, and the model masks their cross-attention out)."""
    rows, length = input_ids.shape
    found = input_ids == image_token
    if not bool(found.any(-1).all()):
        raise ValueError("every row must hold its image's token: a cross-attention mask marks the tokens after it")
    first = found.long().argmax(-1)
    after = torch.arange(length)[None] >= first[:, None]
    mask = torch.zeros(rows, length, 1, tiles, dtype=torch.long)
    mask[:, :, 0, 0] = after.long()
    return mask


def tile_count(vision: Any) -> int:
    """The tiles a Mllama-style tower pads every image to."""
    return getattr(vision, "max_num_tiles", None) or 1
