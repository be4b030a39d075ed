"""A batch's image inputs by row: which images (and, for Qwen2-VL's flattened patches, which patches) each row's
placeholders stand for, so that any set of rows (a pipeline's micro-batch, a data-parallel rank's share) gets its
own images, however many each row holds.

Images follow each other in the order of their placeholders, row after row, as a processor lays them out: the
first ``k`` placeholders of row 0 are image 0's, and so on. An image's placeholder count is its grid's merged size
where the batch gives grids (``image_grid_thw``: ``t * h * w / spatial_merge_size ** 2``), what a packed layout's
grids say (:mod:`~lightning_automodel.hf.vision.packed_images`: MiniCPM-V's ``target_sizes``, Molmo2's
``image_grids``), one a patch where each patch is a token (Inkling's), its runs of placeholders where each image's
views set it (:mod:`~lightning_automodel.hf.vision.local_views`: DeepSeek-OCR 2's crops), else the config's
one count an image (:func:`~lightning_automodel.hf.vision.image_inputs.image_token_count`). Each image input holds
its images one after another along one dimension (the last for MiniCPM-V's pixels, the first otherwise); a set of
rows takes its images' entries of each (an image's crops by its ``num_local_patches``), and Molmo2's pooling
indices, which point into the whole batch's patches, are re-based on the patches it keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_automodel.hf.vision.image_inputs import image_arguments, image_token
from lightning_automodel.hf.vision.local_views import CROP_GRID, CROPS, LOCAL, takes_local_views, view_placeholders
from lightning_automodel.hf.vision.packed_images import (
    PACKED,
    POOLED,
    POOLED_INPUTS,
    images_layout,
    packed_blocks,
    packed_layout,
)
from lightning_automodel.hf.vision.patches import PATCH_TOKENS, merge_size

# Split by image (a row's images).
BY_IMAGE = ("pixel_values", "image_grid_thw", PACKED, *POOLED_INPUTS, LOCAL, CROPS, CROP_GRID)
BY_ROW = ("token_type_ids", "mm_token_type_ids")  # (rows, tokens), for every layer's mask


@dataclass(frozen=True)
class Blocks:
    """An image input holding its images one after another along ``dim``: image ``i``'s entries are ``bounds[i]:
    bounds[i + 1]``. ``pointed``: where its values index another input's entries (Molmo2's pooling), image ``i``'s
    of those (``pointed[i]:pointed[i + 1]``)."""

    value: Tensor
    dim: int
    bounds: Tensor
    pointed: Tensor | None = None

    def of(self, images: Tensor) -> Tensor:
        """The entries of ``images`` (indices, in order), indices re-based on the entries they keep."""
        index = torch.cat([torch.arange(self.bounds[i], self.bounds[i + 1]) for i in images.tolist()])
        taken = self.value.index_select(self.dim, index.to(self.value.device))
        if self.pointed is None:
            return taken
        sizes = self.pointed[images + 1] - self.pointed[images]
        shift = torch.cumsum(sizes, 0) - sizes - self.pointed[images]  # each image's first index, kept minus whole
        shift = torch.repeat_interleave(shift, self.bounds[images + 1] - self.bounds[images]).to(taken.device)
        return torch.where(taken >= 0, taken + shift.view(-1, *[1] * (taken.dim() - 1)), taken)


@dataclass(frozen=True)
class ImageRows:
    """A batch's images, each row's found: ``images[r]:images[r + 1]`` are row ``r``'s images; ``blocks`` each image
    input, laid out by image."""

    images: Tensor
    blocks: dict[str, Blocks]

    def count(self, rows: Tensor) -> int:
        """How many images ``rows`` hold."""
        return sum(int(self.images[r + 1] - self.images[r]) for r in rows.tolist())

    def of_rows(self, rows: Tensor) -> dict[str, Tensor]:
        """The image inputs of ``rows`` (row indices of the batch, in order): none where they hold no image, and
        none of an input with no entries for them (crops of images too small to crop), as a processor leaves it out."""
        images = torch.cat([torch.arange(self.images[r], self.images[r + 1]) for r in rows.tolist()])
        if not len(images):
            return {}
        taken = {name: block.of(images) for name, block in self.blocks.items()}
        return {name: value for name, value in taken.items() if value.numel()}


def image_rows(model: nn.Module, input_ids: Tensor, *, images: dict[str, Tensor], tokens_per_image: int) -> ImageRows:
    """The images of each row of ``input_ids``, found from its placeholders; ``images``: the batch's image inputs
    (:data:`BY_IMAGE`), ``tokens_per_image`` the placeholders of an image without a grid
    (:func:`~lightning_automodel.hf.vision.image_inputs.image_token_count` of the model). Raises a ValueError
    naming the row where a row's placeholders are not those of whole images, or where the batch's images and
    placeholders do not add up."""
    tokens, blocks = by_image(model, images, tokens_per_image=tokens_per_image, input_ids=input_ids)
    placeholders = (input_ids == image_token(model.config)).sum(1).cpu()
    ends = torch.cumsum(tokens, 0)
    row_ends = torch.cumsum(placeholders, 0)
    short = {name: block for name, block in blocks.items() if int(block.bounds[-1]) != block.value.shape[block.dim]}
    if row_ends[-1] != (ends[-1] if len(ends) else 0) or short:
        given = ", ".join(
            f"{name}: {int(block.bounds[-1])} entries along dimension {block.dim} expected,"
            f" {block.value.shape[block.dim]} given"
            for name, block in short.items()
        )
        raise ValueError(
            f"{type(model).__name__}: the batch's rows hold {int(row_ends[-1])} image placeholders and its"
            f" {len(tokens)} images stand for {int(ends[-1]) if len(ends) else 0}{f' ({given})' if given else ''}:"
            " give each image's pixels (and grid), in the order of their placeholders."
        )
    cut = (row_ends != 0) & ~torch.isin(row_ends, ends)
    if cut.any():
        row = int(cut.nonzero()[0])
        raise ValueError(
            f"{type(model).__name__}: row {row} of the batch ends inside an image's placeholders (its"
            f" {int(placeholders[row])} placeholders are not those of whole images, {tokens.tolist()} an image in"
            " order): every image's placeholders must lie in one row."
        )
    zero = torch.zeros(1, dtype=torch.long)
    return ImageRows(images=torch.cat([zero, torch.searchsorted(ends, row_ends, right=True)]), blocks=blocks)


def splits_by_image(model: nn.Module) -> bool:
    """Whether a set of ``model``'s rows takes other than its rows' share of each image input's first dimension (a
    layout packed across the batch, crops of any number an image, patches of one token each)."""
    return packed_layout(model) is not None or takes_local_views(model) or PATCH_TOKENS in image_arguments(model)


def by_image(
    model: nn.Module, images: dict[str, Tensor], *, tokens_per_image: int, input_ids: Tensor | None = None
) -> tuple[Tensor, dict[str, Blocks]]:
    """Each image's placeholders, and each image input as :class:`Blocks` (``tokens_per_image``: see
    :func:`image_rows`; ``input_ids``: the rows' tokens, in which a model of local views finds each image's)."""
    pixels = images["pixel_values"]
    if takes_local_views(model):
        if input_ids is None:
            raise ValueError(f"{type(model).__name__}: its images' views are found in the token ids, none given.")
        crops = images.get(CROPS, torch.zeros(len(pixels), dtype=torch.long)).cpu()
        tokens = view_placeholders(input_ids, token=image_token(model.config), crops=crops)
        ones = _bounds(torch.ones(len(pixels), dtype=torch.long))
        blocks = {name: Blocks(images[name], 0, ones) for name in ("pixel_values", CROPS, CROP_GRID) if name in images}
        return tokens, {**blocks, **({LOCAL: Blocks(images[LOCAL], 0, _bounds(crops))} if LOCAL in images else {})}
    if PATCH_TOKENS in image_arguments(model):
        tokens_per_image = 1  # each entry a patch, a token
    if images_layout(images) is not None:
        tokens, extents, pointed = packed_blocks(model, images)
        blocks = {name: Blocks(images[name], dim, _bounds(sizes)) for name, (dim, sizes) in extents.items()}
        if pointed is not None:
            blocks[POOLED] = Blocks(images[POOLED], 0, blocks[POOLED].bounds, pointed=_bounds(pointed))
        return tokens, blocks
    grids = images.get("image_grid_thw")
    if grids is None:
        tokens = torch.full((len(pixels),), tokens_per_image)
        return tokens, {"pixel_values": Blocks(pixels, 0, _bounds(torch.ones_like(tokens)))}
    sizes = grids.cpu().prod(-1)
    merge = merge_size(model.config.vision_config, accepted=image_arguments(model))
    blocks = {"pixel_values": Blocks(pixels, 0, _bounds(sizes))}
    return sizes // merge**2, {**blocks, "image_grid_thw": Blocks(grids, 0, _bounds(torch.ones_like(sizes)))}


def _bounds(sizes: Tensor) -> Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(sizes.long(), 0)])
