"""Multimodal rotary positions (M-RoPE: Qwen2-VL, Qwen2.5-VL, Qwen3-VL): three position ids a token (time, height,
width), an image's tokens placed on its grid, found by the model class's own ``get_rope_index``.

Packed rows give these models four rows of position ids, ``(4, batch, seq)``: the first the text positions, restarting
at each record, from which transformers builds the mask that keeps the records apart (with three rows it builds no
such mask, and records see each other); the other three the M-RoPE positions, each record's found alone.
"""

from __future__ import annotations

import torch
import transformers
from torch import Tensor, nn
from transformers import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

from lightning_automodel.hf.vision.image_inputs import image_token

# The model types whose text model takes (4, batch, seq) position ids and masks packed records by their first row.
MROPE_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")


def is_mrope(config: transformers.PretrainedConfig) -> bool:
    """Whether a model of ``config`` takes its packed rows' position ids in four rows."""
    return getattr(config, "model_type", None) in MROPE_MODEL_TYPES


class RopeIndex:
    """The base model class's ``get_rope_index`` of ``model_type``, on an instance holding its config alone (no
    weights: the function reads only the config's spatial merge, which is the image processor's ``merge_size``)."""

    def __init__(self, model_type: str, *, merge_size: int) -> None:
        config = CONFIG_MAPPING[model_type]()
        config.vision_config.spatial_merge_size = merge_size
        holder = object.__new__(getattr(transformers, MODEL_MAPPING_NAMES[model_type]))
        nn.Module.__init__(holder)
        holder.config = config
        self.holder = holder

    def __call__(self, input_ids: Tensor, *, image_types: Tensor, grids: Tensor | None) -> Tensor:
        """One record's M-RoPE positions, ``(3, len)``, as the model finds them for the record alone."""
        positions, _ = self.holder.get_rope_index(
            input_ids.unsqueeze(0), mm_token_type_ids=image_types.unsqueeze(0), image_grid_thw=grids
        )
        return positions[:, 0]


def whole_row_positions(
    model: nn.Module, input_ids: Tensor, *, images: dict[str, Tensor], tokens: dict[str, Tensor]
) -> Tensor:
    """The M-RoPE positions, ``(3, batch, seq)``, a multimodal rotary ``model`` finds for whole rows of
    ``input_ids`` with their images: found before a split of the rows (context parallel), where the model's own
    forward would see a rank's share of each row."""
    types = tokens.get("mm_token_type_ids")
    if types is None:
        types = (input_ids == image_token(model.config)).long()
    positions, _ = model.base_model.get_rope_index(
        input_ids, mm_token_type_ids=types, image_grid_thw=images.get("image_grid_thw")
    )
    return positions


def text_positions(position_ids: Tensor) -> Tensor:
    """The text positions, ``(batch, seq)``, in position ids of one row or of several a token: the first of four
    (see above); three give none (each row one record, as transformers reads them)."""
    if position_ids.dim() == 2:
        return position_ids
    if position_ids.size(0) == 4:
        return position_ids[0]
    batch, length = position_ids.shape[1:]
    return torch.arange(length, device=position_ids.device).expand(batch, -1)
