"""A batch's image inputs by row: which images (and, for Qwen2-VL's flattened patches, which patches) each row's
placeholders stand for, so that any set of rows (a pipeline's micro-batch) gets its own images, however many each
row holds.

Images follow each other in the order of their placeholders, row after row, as a processor lays them out: the
first ``k`` placeholders of row 0 are image 0's, and so on. An image's placeholder count is its grid's merged size
where the batch gives grids (``image_grid_thw``: ``t * h * w / spatial_merge_size ** 2``), else the config's one count
an image (:func:`~lightning_automodel.hf.vision.image_inputs.image_token_count`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_automodel.hf.vision.image_inputs import image_arguments, image_token
from lightning_automodel.hf.vision.patches import merge_size

BY_IMAGE = ("pixel_values", "image_grid_thw")  # split by image (a row's images), for the tower
BY_ROW = ("token_type_ids", "mm_token_type_ids")  # (rows, tokens), for every layer's mask


@dataclass(frozen=True)
class ImageRows:
    """A batch's images, each row's found: ``images[r]:images[r + 1]`` are row ``r``'s images, ``patches[i]:patches[i
    + 1]`` image ``i``'s rows of ``pixel_values`` (one each unless the batch gives grids)."""

    images: Tensor
    patches: Tensor
    pixel_values: Tensor
    grids: Tensor | None

    def count(self, rows: Tensor) -> int:
        """How many images ``rows`` hold."""
        return sum(int(self.images[r + 1] - self.images[r]) for r in rows.tolist())

    def of_rows(self, rows: Tensor) -> dict[str, Tensor]:
        """The image inputs of ``rows`` (row indices of the batch, in order): none where they hold no image."""
        images = torch.cat([torch.arange(self.images[r], self.images[r + 1]) for r in rows.tolist()])
        if not len(images):
            return {}
        patches = torch.cat([torch.arange(self.patches[i], self.patches[i + 1]) for i in images.tolist()])
        found = {"pixel_values": self.pixel_values[patches.to(self.pixel_values.device)]}
        if self.grids is not None:
            found["image_grid_thw"] = self.grids[images.to(self.grids.device)]
        return found


def image_rows(
    model: nn.Module, input_ids: Tensor, *, pixel_values: Tensor, grids: Tensor | None, tokens_per_image: int
) -> ImageRows:
    """The images of each row of ``input_ids``, found from its placeholders (``tokens_per_image`` an image without a
    grid: :func:`~lightning_automodel.hf.vision.image_inputs.image_token_count` of the model). Raises a ValueError
    naming the row where a row's placeholders are not those of whole images, or where the batch's images and
    placeholders do not add up."""
    placeholders = (input_ids == image_token(model.config)).sum(1).cpu()
    if grids is not None:
        merge = merge_size(model.config.vision_config, accepted=image_arguments(model))
        sizes = grids.cpu().prod(-1)
        tokens = sizes // merge**2
    else:
        tokens = torch.full((len(pixel_values),), tokens_per_image)
        sizes = torch.ones_like(tokens)
    ends = torch.cumsum(tokens, 0)
    row_ends = torch.cumsum(placeholders, 0)
    if row_ends[-1] != (ends[-1] if len(ends) else 0) or int(sizes.sum()) != len(pixel_values):
        raise ValueError(
            f"{type(model).__name__}: the batch's rows hold {int(row_ends[-1])} image placeholders and its"
            f" {len(tokens)} images stand for {int(ends[-1]) if len(ends) else 0} ({int(sizes.sum())} rows of"
            f" pixel_values expected, {len(pixel_values)} given): give each image's pixels (and grid), in the"
            " order of their placeholders."
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
    return ImageRows(
        images=torch.cat([zero, torch.searchsorted(ends, row_ends, right=True)]),
        patches=torch.cat([zero, torch.cumsum(sizes, 0)]),
        pixel_values=pixel_values,
        grids=grids,
    )
