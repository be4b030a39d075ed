"""The images a planned training step of a vision-language model carries: its rows hold image placeholders and the
step the pixels, the model's own inputs (:mod:`~lightning_automodel.hf.vision.image_inputs`), so that the activation
estimate counts the vision tower's activations and the image tokens' share of the language model's.

By default one image a row where the model takes images, of the size its config fixes (LLaVA's, Gemma 3's); a tower
that takes images of any size (Qwen2-VL's merged patches) is planned with images of :data:`DEFAULT_IMAGE_TOKENS`
tokens unless told otherwise: the data's images decide what a real step holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lightning_automodel.hf.vision.image_inputs import (
    check_image_tokens,
    image_inputs,
    image_token_count,
    takes_any_image_size,
)

# Tokens of an image for a tower taking images of any size: a 448 x 448 picture at Qwen2-VL's 14-pixel patches,
# merged 2 x 2.
DEFAULT_IMAGE_TOKENS = 256


@dataclass(frozen=True)
class StepImages:
    """The images each row of a planned step holds."""

    per_row: int
    tokens: int  # placeholders an image

    def __str__(self) -> str:
        return f"{self.per_row} image{'s' * (self.per_row > 1)} a row of {self.tokens:,} tokens each"

    def check_fits(self, seq_len: int) -> None:
        """Refuse rows of ``seq_len`` tokens too short for these images (a text token before each)."""
        needed = self.per_row * (self.tokens + 1)
        if seq_len < needed:
            raise ValueError(
                f"rows of {seq_len:,} tokens cannot hold {self} ({needed:,} tokens with a text token before each):"
                " plan fewer images_per_row, smaller images (image_tokens, for a tower taking any size) or longer rows."
            )

    @staticmethod
    def check_layout(*, loss_chunks: int) -> None:
        """Refuse what a step with images cannot run: the chunked loss (it takes no image inputs)."""
        if loss_chunks > 1:
            raise ValueError(f"loss_chunks={loss_chunks}: the chunked loss takes no image inputs; plan loss_chunks=1.")

    def inputs(self, model: nn.Module, *, rows: int, tokens: int) -> dict[str, torch.Tensor]:
        """The forward's arguments for ``rows`` rows of ``tokens`` tokens holding these images: token ids and image
        metadata on the CPU (the model's code reads their values), pixels on the meta device (shapes alone)."""
        return image_inputs(
            model, rows=rows, tokens=tokens, images_per_row=self.per_row, image_tokens=self.tokens, pixels_device="meta"
        )


def step_images(
    model: nn.Module, *, images_per_row: int | None = None, image_tokens: int | None = None
) -> StepImages | None:
    """The images a planned step of ``model`` carries: ``images_per_row`` (None: one where the model takes images,
    0: none) of ``image_tokens`` tokens (None: the size its config fixes, else :data:`DEFAULT_IMAGE_TOKENS`); None for
    a step without images. A model taking no images the builder knows is refused images."""
    count = image_token_count(model)
    if count is None:
        if images_per_row or image_tokens is not None:
            raise ValueError(
                f"images_per_row={images_per_row}, image_tokens={image_tokens}: {type(model).__name__} takes no images"
                " the planner can build (its config gives no image placeholder and pixel sizes); leave them unset."
            )
        return None
    per_row = 1 if images_per_row is None else images_per_row
    if per_row == 0:
        return None
    check_image_tokens(model, image_tokens)
    if image_tokens is None:
        image_tokens = DEFAULT_IMAGE_TOKENS if takes_any_image_size(model) else count
    return StepImages(per_row, image_tokens)
