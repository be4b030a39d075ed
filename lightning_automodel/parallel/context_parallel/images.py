"""Images under context parallel. The cp ranks of a group hold the same rows, so the same images: each encodes a
contiguous share of them (the tower runs once an image, not once a rank), the ranks gather every image's features
(through autograd: a rank's tower gets the gradient of every rank's use of its images), and a rank's language model
takes the features of the placeholders it holds, handed to the model as its ``mm_encoder_outputs`` (transformers'
argument for features computed beforehand), in the order its own merge scatters them.

Images packed across the batch (MiniCPM-V's, Molmo2's: :mod:`~lightning_automodel.hf.vision.packed_images`) are cut
into whole images as a pipeline's micro-batches take them, each share re-packed.

A rank whose share is empty (fewer images than cp ranks) runs the tower on a stand-in image (a packed batch's first
image) and keeps none of its features, so that its backward runs too, with a zero gradient: FSDP2 gathers a unit's
weights, and reduces its gradient, on every rank that shards it."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten
from transformers.modeling_outputs import BaseModelOutputWithPooling

from lightning_automodel.hf.vision.image_inputs import image_arguments, image_token, pixel_inputs
from lightning_automodel.hf.vision.image_rows import by_image
from lightning_automodel.hf.vision.packed_images import PACKED, POOLED, POOLED_INPUTS, images_layout
from lightning_automodel.hf.vision.patch_sequences import tower_config
from lightning_automodel.parallel.context_parallel.sequence_split import all_gather_autograd

# Per image: the pixels (or a Qwen-style tower's patches, counted by its grid) and the image's metadata; or images
# packed across the batch (hf/vision/packed_images.py).
IMAGE_INPUTS = ("pixel_values", "image_grid_thw", "image_sizes", PACKED, *POOLED_INPUTS)
# One value a token, split with the sequence as the token ids are.
TOKEN_INPUTS = ("token_type_ids", "mm_token_type_ids")


def has_images(inputs: dict[str, Any]) -> bool:
    pixels = inputs.get("pixel_values")
    return isinstance(pixels, Tensor) and pixels.numel() > 0


def held_image_arguments(
    model: nn.Module,
    images: dict[str, Tensor],
    *,
    input_ids: Tensor,
    index: Tensor,
    group: dist.ProcessGroup | None,
    rank: int,
    cp: int,
) -> dict[str, Any]:
    """The model's arguments for the images of whole rows ``input_ids`` when it is called with their tokens
    ``index`` alone: the features of the placeholders among those, as its ``mm_encoder_outputs``."""
    features, per_image = image_features(model, images, group=group, rank=rank, cp=cp)
    held = held_features(features, input_ids=input_ids, index=index, model=model)
    return {"mm_encoder_outputs": encoder_outputs(held, per_image=per_image)}


def image_features(
    model: nn.Module, inputs: dict[str, Any], *, group: dist.ProcessGroup | None, rank: int, cp: int
) -> tuple[Tensor, bool]:
    """Every image's features of the batch, one row a placeholder in the images' order, gathered over the cp
    ranks of ``group`` (None: this process encodes them all); and whether the model gives them image by image (a
    tuple, which its merge concatenates) rather than as one tensor."""
    cp = cp if group is not None else 1
    shares = _packed_shares(model, inputs, cp=cp) if images_layout(inputs) else _image_shares(inputs, cp=cp)
    share = shares[rank if group is not None else 0]
    if share is None:  # no image of its own: a stand-in's features, none of them kept
        own, per_image = _flat_features(model, _stand_in(model, inputs, shares=shares))
        own = own[:0]
    else:
        own, per_image = _flat_features(model, share)
    return (own if group is None else _gather_rows(own, group=group)), per_image


def held_features(features: Tensor, *, input_ids: Tensor, index: Tensor, model: nn.Module) -> Tensor:
    """The features of the placeholders among the tokens ``index`` of each row of ``input_ids`` (the whole rows),
    in the order the model's merge fills them: row by row, position by position."""
    placeholders = input_ids == image_token(model.config)
    if int(placeholders.sum()) != features.size(0):
        raise ValueError(
            f"{type(model).__name__}: the rows hold {int(placeholders.sum())} image placeholders and the images give"
            f" {features.size(0)} features: a record's placeholders must be those its processor made for its images."
        )
    ordinal = placeholders.flatten().cumsum(0).view_as(input_ids) - 1
    held = placeholders[:, index]
    return features[ordinal[:, index][held]]


def encoder_outputs(features: Tensor, *, per_image: bool) -> dict[str, BaseModelOutputWithPooling]:
    """``features`` as a model's ``mm_encoder_outputs``, in the form its own tower gives: a tuple of them where the
    merge concatenates images' features (LLaVA, Qwen2-VL), one tensor where it scatters them (Gemma 3)."""
    return {"image": BaseModelOutputWithPooling(pooler_output=(features,) if per_image else features)}


def _image_shares(inputs: dict[str, Any], *, cp: int) -> list[dict[str, Tensor] | None]:
    """The image inputs cut into ``cp`` contiguous shares of whole images (None for an empty one)."""
    grids = inputs.get("image_grid_thw")
    images = grids.size(0) if isinstance(grids, Tensor) else inputs["pixel_values"].size(0)
    bounds = [images * rank // cp for rank in range(cp + 1)]
    patches = grids.prod(-1).cumsum(0).tolist() if isinstance(grids, Tensor) else None
    shares: list[dict[str, Tensor] | None] = []
    for start, stop in pairwise(bounds):
        if start == stop:
            shares.append(None)
            continue
        share = {name: inputs[name][start:stop] for name in IMAGE_INPUTS if isinstance(inputs.get(name), Tensor)}
        if patches is not None:  # the patches of every image in one list: an image's are its grid's count
            first, last = (patches[start - 1] if start else 0), patches[stop - 1]
            share["pixel_values"] = inputs["pixel_values"][first:last]
        shares.append(share)
    return shares


def _packed_shares(model: nn.Module, inputs: dict[str, Any], *, cp: int) -> list[dict[str, Tensor] | None]:
    """Images packed across the batch cut into ``cp`` contiguous shares of whole images, each re-packed
    (:func:`~lightning_automodel.hf.vision.image_rows.by_image`; None for an empty one)."""
    images = {name: inputs[name] for name in IMAGE_INPUTS if name in inputs}
    tokens, blocks = by_image(model, images, tokens_per_image=0)
    bounds = [len(tokens) * rank // cp for rank in range(cp + 1)]
    shares: list[dict[str, Tensor] | None] = []
    for start, stop in pairwise(bounds):
        held = torch.arange(start, stop)
        shares.append({name: block.of(held) for name, block in blocks.items()} if stop > start else None)
    return shares


def _stand_in(model: nn.Module, inputs: dict[str, Any], *, shares: list[dict[str, Tensor] | None]) -> dict[str, Tensor]:
    """The image a rank whose share is empty encodes: a packed batch's first (the builder lays a stand-in out by the
    model's forward, which context parallel took over), else one built from the config."""
    if images_layout(inputs):
        return next(share for share in shares if share is not None)
    device = inputs["pixel_values"].device
    return pixel_inputs(tower_config(model.config), images=1, device=device, accepted=image_arguments(model))


def _flat_features(model: nn.Module, share: dict[str, Tensor]) -> tuple[Tensor, bool]:
    """The tower's and projector's features of ``share``'s images, one row a placeholder; and whether the model gave
    them image by image."""
    output = model.get_image_features(**share, return_dict=True).pooler_output
    leaves = [leaf for leaf in tree_flatten(output)[0] if isinstance(leaf, Tensor)]
    return torch.cat([leaf.reshape(-1, leaf.size(-1)) for leaf in leaves]), not isinstance(output, Tensor)


def _gather_rows(rows: Tensor, *, group: dist.ProcessGroup) -> Tensor:
    """Every rank's ``rows`` concatenated in rank order (their counts differ: each pads to the largest)."""
    counts = torch.zeros(dist.get_world_size(group), dtype=torch.long, device=rows.device)
    dist.all_gather_into_tensor(counts, torch.tensor([rows.size(0)], device=rows.device), group=group)
    counts = counts.tolist()
    longest = max(counts)
    padded = F.pad(rows, (0, 0, 0, longest - rows.size(0)))
    gathered = funcol.wait_tensor(all_gather_autograd(padded.contiguous(), 0, group)).view(len(counts), longest, -1)
    return torch.cat([gathered[rank, :count] for rank, count in enumerate(counts)])


def token_blocks(tokens: dict[str, Tensor], *, images: dict[str, Any]) -> Tensor | None:
    """Each token's block of image tokens that see each other both ways (-1 for others; None where the model has
    none): Gemma 3's images, each its own (:func:`image_blocks`); Molmo2's (``image_token_pooling``), every image
    token of a row one block, as its forward's mask makes them from ``mm_token_type_ids``."""
    if "token_type_ids" in tokens:
        return image_blocks(tokens["token_type_ids"])
    if images_layout(images) == POOLED and "mm_token_type_ids" in tokens:
        return torch.where(tokens["mm_token_type_ids"] == 1, 0, -1)
    return None


def image_blocks(token_type_ids: Tensor) -> Tensor:
    """Each token's image in its row, counted from 0 (-1 for text), from token types that mark an image's tokens 1:
    a model that takes them lets an image's tokens see each other both ways (Gemma 3)."""
    image = token_type_ids == 1
    starts = image & ~F.pad(image, (1, 0))[:, :-1]
    return torch.where(image, starts.long().cumsum(-1) - 1, -1)
