"""Several vision records a row (``pack=True``), each computed as if alone: which models allow it, and their
positions.

A packed row's position ids restart at each record and it has no attention mask, so transformers' mask keeps the
records apart (its own attention functions build it from the position ids; FlashAttention takes its
variable-length path). The row's images are the records' images in order, as the model scatters their features
into its image tokens in order. An M-RoPE model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) gets ``(4, seq)`` position ids a
row: the restarting text positions, which its text model masks by, and each record's own M-RoPE positions
(:mod:`lightning_automodel.hf.vision.mrope`). Packing is refused for a model whose records cannot be kept apart so.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

from lightning_automodel.hf.vision.mrope import MROPE_MODEL_TYPES, RopeIndex

# Models whose attention keeps packed records apart by the restarting position ids, images included.
PLAIN_POSITIONS = ("llava",)
# Why a model's packed records would not be computed as if alone.
_NOT_EXACT = {
    "gemma3": "its sliding-window layers look up which tokens are an image's (attended both ways) at the packed"
    " position ids rather than the row's tokens (transformers 5.24), so a later record's tokens attend as if they"
    " were another's image tokens",
}


def processor_model_type(processor: Any) -> str | None:
    """The model type whose processor ``processor`` is (or derives from), or None."""
    names = {kind.__name__ for kind in type(processor).__mro__}
    return next((model_type for model_type, name in PROCESSOR_MAPPING_NAMES.items() if name in names), None)


def packing_rope_index(processor: Any) -> RopeIndex | None:
    """The M-RoPE positions' function for ``processor``'s model (None: plain positions); a ``ValueError`` naming the
    fix where packed records could not be kept apart."""
    model_type = processor_model_type(processor)
    if model_type in MROPE_MODEL_TYPES:
        return RopeIndex(model_type, merge_size=processor.image_processor.merge_size)
    if model_type in PLAIN_POSITIONS:
        return None
    checked = ", ".join((*PLAIN_POSITIONS, *MROPE_MODEL_TYPES))
    why = _NOT_EXACT.get(model_type, f"packing images is checked for {checked} only")
    raise ValueError(
        f"pack=True: {type(processor).__name__} (model type {model_type}) cannot pack records exactly: {why}. Set"
        " pack=False (one record a row, padded)."
    )


def packed_positions(
    row: dict[str, torch.Tensor], *, lengths: list[int], images: list[int], rope_index: RopeIndex
) -> torch.Tensor:
    """The row's ``(4, seq)`` position ids: its text positions (restarting at each record; padding counts on) above
    each record's M-RoPE positions, found for the record alone from its images' grids (``images``: how many of the
    row's grids are each record's)."""
    text = row["position_ids"]
    mrope = text.expand(3, -1).clone()
    grids = row["image_grid_thw"].split(images) if sum(images) else [None] * len(images)
    at = 0
    for length, count, record_grids in zip(lengths, images, grids, strict=True):
        span = slice(at, at + length)
        image_types = row["mm_token_type_ids"][span]
        mrope[:, span] = rope_index(
            row["input_ids"][span], image_types=image_types, grids=record_grids if count else None
        )
        at += length
    return torch.cat([text.unsqueeze(0), mrope])
