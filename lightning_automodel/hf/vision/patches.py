"""Image inputs of towers that take images of any size as patches (Qwen2-VL and its like), beside the fixed-size
images of :mod:`~lightning_automodel.hf.vision.image_inputs`: the patches of each image, one row each, and each
image's grid. The layouts differ by what the tower says of itself:

* flattened patches of ``channels x temporal_patch_size x patch_size ** 2`` and grids in patches (Qwen2-VL);
* unflattened, ``(channels, patch, patch)``, where the tower documents them so (PaddleOCR-VL);
* each language-model token's merged patches as one block of pixels, channels last, with grids counted in tokens,
  for a tower whose forward takes ``image_grid_thw`` (Inkling2's; Qwen2-VL's takes ``grid_thw``, in patches);
* each image's merge size (``image_merge_sizes``) where the forward takes it and the config gives none (VideoLLaMA3);
* flattened patches with each image's ``image_grid_hw`` (height, width) in patches, 2 x 2 of them a token, where the
  forward takes that (Nemotron-H Omni's packed patches, pixel-shuffled);
* one token a patch, each patch its frames of pixels, ``(temporal_patch_size, patch, patch, channels)``, and no grid,
  for a tower that folds a patch's time and space into depth itself: its config gives a ``temporal_patch_size`` but
  no merge and no image size (Inkling's). The builder's image: ``PATCH_TOKEN_GRID`` patches.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import torch
from torch import nn

UNFLATTENED = "unflattened_patches"
TOKEN_GRID = "image_grid_thw"
MERGE_SIZES = "image_merge_sizes"
_UNFLATTENED_DOC = re.compile(r"pixel_values \(`torch\.\w+` of shape `\([^`]*channels, patch_size, patch_size\)`")
GRID_HW = "image_grid_hw"
PATCH_TOKENS = "patch_tokens"
PATCH_TOKEN_GRID = (2, 2)  # the builder's image of one token a patch: rows x columns of patches
# Nemotron-H Omni's pixel shuffle of packed patches: 2 x 2 patches a token (its code splits features by 2 ** 2).
SHUFFLED = 2


def merge_size(vision: Any, *, accepted: set[str]) -> int | None:
    """How many patches a side a tower of patches of any size merges into one token: its config's
    ``spatial_merge_size`` (``merge_size`` as Muse names it, a square ``merge_kernel_size`` as Kimi-K2.5's), else 1
    where the forward takes each image's (VideoLLaMA3's processor merges none of an image's); None for a tower of
    fixed-size images."""
    merge = getattr(vision, "spatial_merge_size", None) or getattr(vision, "merge_size", None)
    kernel = getattr(vision, "merge_kernel_size", None)
    if isinstance(kernel, list | tuple) and len(set(kernel)) == 1:
        merge = kernel[0]
    if isinstance(merge, int):
        return merge
    if GRID_HW in accepted:
        return SHUFFLED
    return 1 if MERGE_SIZES in accepted else None


def patch_layout(tower: nn.Module) -> set[str]:
    """What of the layouts above ``tower`` takes: :data:`TOKEN_GRID` where its forward takes ``image_grid_thw``,
    :data:`UNFLATTENED` where its forward's documentation gives ``pixel_values`` the shape of unflattened patches
    (PaddleOCR-VL's; the module's code alone does not tell: HY-V4-VL's, also a 2-D patch embedding, reshapes
    flattened ones itself), :data:`PATCH_TOKENS` where its config folds frames of patches but merges none and gives
    no image size."""
    documented = _UNFLATTENED_DOC.search(inspect.getdoc(tower.forward) or "")
    config = getattr(tower, "config", None)
    folded = getattr(config, "temporal_patch_size", None) is not None and getattr(config, "image_size", None) is None
    tokens = {PATCH_TOKENS} if folded and merge_size(config, accepted=set()) is None else set()
    return ({TOKEN_GRID} & _arguments(tower)) | ({UNFLATTENED} if documented else set()) | tokens


def patch_token_pixels(vision: Any, *, images: int, device: Any) -> dict[str, torch.Tensor]:
    """The :data:`PATCH_TOKENS` pixels of ``images`` images of ``PATCH_TOKEN_GRID`` patches each, image after image:
    (patches, frames, patch, patch, channels), as its processor stacks a patch's frames channels last."""
    patch, frames = side(vision.patch_size), vision.temporal_patch_size
    patches = images * PATCH_TOKEN_GRID[0] * PATCH_TOKEN_GRID[1]
    return {"pixel_values": random_pixels((patches, frames, patch, patch, channel_count(vision)), device=device)}


def patch_pixels(
    vision: Any, *, images: int, merge: int, grid: tuple[int, int, int], device: Any, accepted: set[str]
) -> dict[str, torch.Tensor]:
    """The patches of ``images`` images of ``grid`` merged blocks (time, height, width) each, and their grids, in the
    layout ``accepted`` names (see above)."""
    channels = channel_count(vision)
    frames = getattr(vision, "temporal_patch_size", None) or getattr(vision, "patch_temporal", None) or 1
    patch = side(vision.patch_size)
    if TOKEN_GRID in accepted:
        tokens = torch.tensor([grid] * images)
        block = merge * patch
        return {
            "pixel_values": random_pixels((int(tokens.prod(-1).sum()), block, block, channels), device=device),
            "image_grid_thw": tokens,
        }
    grids = torch.tensor([[grid[0], grid[1] * merge, grid[2] * merge]] * images)
    shape = (channels, patch, patch) if UNFLATTENED in accepted else (channels * frames * patch * patch,)
    sizes = {MERGE_SIZES: torch.full((images,), merge)} if MERGE_SIZES in accepted else {}
    pixels = random_pixels((int(grids.prod(-1).sum()), *shape), device=device)
    if GRID_HW in accepted:  # one frame: (height, width) alone
        return {"pixel_values": pixels, GRID_HW: grids[:, 1:]}
    return {"pixel_values": pixels, "image_grid_thw": grids, **sizes}


def channel_count(vision: Any) -> int:
    return getattr(vision, "num_channels", None) or getattr(vision, "in_channels", None) or 3


def side(size: Any) -> int:
    """A square image's (or patch's) side, from an int or a (height, width) pair."""
    return size[0] if isinstance(size, list | tuple) else size


def random_pixels(shape: tuple[int, ...], *, device: Any) -> torch.Tensor:
    """Seeded random pixels (empty on the meta device)."""
    if torch.device(device).type == "meta":
        return torch.empty(shape, device="meta")
    return torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device)


def _arguments(module: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return set()
