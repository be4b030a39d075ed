"""A vision-language model's images under pipeline parallel: the vision tower and projector run on the first stage,
each micro-batch on its own rows' images; later stages receive the hidden states the features were scattered into,
and every stage the token-level inputs its layers' masks and positions read.

A call's image inputs are split by row before the schedule (:mod:`~lightning_automodel.hf.vision.image_rows`: a row
may hold any number of images, Qwen2-VL's flattened patches go with their image, images packed across the batch are
re-packed), and each micro-batch's stages take their rows' share (the pipeline's ``row_inputs``). M-RoPE positions
(Qwen2-VL; MiniCPM-V 4.7's canvas), which the model would find from the token ids and grids that only the first stage
has, are found once for the whole batch, as the model finds them, and split by row too. Under data parallelism the
first stage's ranks agree, micro-batch by micro-batch, whether some have images and others none: those without run
the tower on a stand-in image (:class:`~lightning_automodel.parallel.fsdp.imageless_ranks.TowerStandIn`), so that
FSDP2's gathers and reductions of the tower's units come in the same order on every rank.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_automodel.hf.decoder_layers import named_multimodal_parts
from lightning_automodel.hf.vision.image_inputs import image_token, image_token_count
from lightning_automodel.hf.vision.image_rows import BY_IMAGE, BY_ROW, ImageRows, image_rows
from lightning_automodel.hf.vision.local_views import takes_local_views
from lightning_automodel.parallel.fsdp.imageless_ranks import TowerStandIn, stand_in_pixels

IMAGE_INPUTS = (*BY_IMAGE, *BY_ROW)  # what a pipelined vision-language model's call takes beside a text model's
# What a language model's forward may take: anything more (Qwen3-VL's deepstack features, Mllama's cross-attention
# states) carries the vision tower's output into its layers, which stages after the first never receive.
LANGUAGE_INPUTS = frozenset(
    ("input_ids", "attention_mask", "position_ids", "cache", "past_key_values", "cache_position", "inputs_embeds")
    + ("use_cache", "output_attentions", "output_hidden_states", "return_dict", "kwargs", "args")
)


def images_problem(model: nn.Module) -> str | None:
    """Why the first stage cannot carry the parts of ``model`` beside its language model (a vision tower and
    projector; None if it can, or if the model has none), found without any collective."""
    parts = [name for name, _ in named_multimodal_parts(model)]
    if parts and takes_local_views(model):
        return (
            f"{type(model).__name__} takes its images in global views and crops, whose placeholders only its code"
            " counts: a micro-batch's first stage could not find its rows' images"
        )
    beside = sorted(set(inspect.signature(model.get_decoder().forward).parameters) - LANGUAGE_INPUTS) if parts else []
    if not beside:
        return None
    return (
        f"{type(model).__name__}'s language model takes {', '.join(beside)} from the parts beside it"
        f" ({', '.join(parts)}), which feed its layers beyond the first stage's (a later stage receives the hidden"
        " states alone)"
    )


class StageImages:
    """The images of a pipelined vision-language model's calls, split into its micro-batches (see the module)."""

    def __init__(self, model: nn.Module) -> None:
        """``model``: the whole model, before its stage is kept (the M-RoPE positions are found by its base model's
        code, which reads no weight)."""
        self.model = model
        self.stand_in: TowerStandIn | None = None
        self._positions = getattr(model.base_model, "compute_3d_position_ids", None)
        # The image grids it places image tokens by: Qwen2-VL's image_grid_thw, MiniCPM-V 4.7's target_sizes.
        taken = inspect.signature(self._positions).parameters if self._positions is not None else {}
        self._position_grids = [name for name in BY_IMAGE if name in taken and name != "pixel_values"]
        self._tokens_per_image = image_token_count(model)  # read from the forward's signature, before pp takes it
        self._stand_in_pixels = stand_in_pixels(model)  # in the layout its forward names (packed across the batch)

    def share_tower(self, stage: nn.Module, mesh: DeviceMesh) -> None:
        """On the first ``stage`` (the model, or its first stage's view), whose tower FSDP2 shards over ``mesh``: a
        micro-batch without images runs the tower on a stand-in image where another rank's has images."""
        self.stand_in = TowerStandIn(stage, mesh, pixels=self._stand_in_pixels)

    def split(
        self, input_ids: Tensor, inputs: dict[str, Any], *, microbatches: int
    ) -> tuple[dict[str, Any], Callable[..., dict[str, Any]]]:
        """The call's ``inputs`` less its image inputs, and ``row_inputs(rows, first=...)``: the image inputs of a
        micro-batch's rows, for its first stage (pixels, grids, token types, positions) or a later one (token types,
        positions). On a first stage sharing its tower over data-parallel ranks, one all-reduce of its group."""
        images = {name: inputs.pop(name) for name in IMAGE_INPUTS if inputs.get(name) is not None}
        by_row = {name: images.pop(name) for name in BY_ROW if name in images}
        positions = self._mrope_positions(input_ids, inputs, images=images, by_row=by_row)
        if positions is not None:  # M-RoPE's (3 or 4, rows, tokens): held rows first
            inputs.pop("position_ids", None)
            by_row["position_ids"] = positions.transpose(0, 1)
        found = None
        if "pixel_values" in images:
            found = self._image_rows(input_ids, images)
        chunks = torch.arange(input_ids.size(0)).chunk(microbatches)
        stand_ins = {int(rows[0]): False for rows in chunks}
        if self.stand_in is not None:
            needed = self.stand_in.needed([found is not None and found.count(rows) > 0 for rows in chunks])
            stand_ins = dict(zip(stand_ins, needed, strict=True))
        return inputs, partial(self._row_inputs, by_row=by_row, found=found, stand_ins=stand_ins)

    def _image_rows(self, input_ids: Tensor, images: dict[str, Tensor]) -> ImageRows:
        if "image_grid_thw" not in images and self._tokens_per_image is None:
            raise ValueError(
                f"{type(self.model).__name__} under pipeline parallel (pp > 1): each micro-batch's first stage takes"
                " its rows' images, found by their image placeholders, and the model's config gives no image"
                " placeholder token and size (image_token_id; vision_config's image_size and patch_size,"
                " mm_tokens_per_image or spatial_merge_size) to count them by. Use pp=1 for this model's images."
            )
        if image_token(self.model.config) is None:
            raise ValueError(
                f"{type(self.model).__name__} under pipeline parallel (pp > 1): each micro-batch's first stage takes"
                " its rows' images, found by their image placeholder tokens, and this model marks its images by no"
                " token (its features are read beside the text, or at positions a mask gives). Use pp=1 for this"
                " model's images."
            )
        tokens_per_image = self._tokens_per_image or 0
        return image_rows(self.model, input_ids, images=images, tokens_per_image=tokens_per_image)

    def _mrope_positions(
        self, input_ids: Tensor, inputs: dict[str, Any], *, images: dict[str, Tensor], by_row: dict[str, Tensor]
    ) -> Tensor | None:
        """The call's M-RoPE positions: those given (3 or 4 rows), else the model's own from its image grids (None
        for other models, or a batch without grids: its layers count positions as text)."""
        given = inputs.get("position_ids")
        if given is not None:
            return given if given.dim() == 3 else None
        grids = {name: images[name] for name in self._position_grids if name in images}
        if not grids:
            return None
        return self._positions(
            input_ids=input_ids,
            inputs_embeds=None,
            attention_mask=inputs.get("attention_mask"),
            mm_token_type_ids=by_row.get("mm_token_type_ids"),
            **grids,
        )

    def _row_inputs(
        self,
        rows: Tensor,
        *,
        first: bool,
        by_row: dict[str, Tensor],
        found: ImageRows | None,
        stand_ins: dict[int, bool],
    ) -> dict[str, Tensor]:
        """A micro-batch's share of the image inputs; on the first stage, its images, and whether its forward runs
        the tower on a stand-in."""
        given = {name: _rows_of(name, value, rows) for name, value in by_row.items()}
        if first:
            given.update(found.of_rows(rows) if found is not None else {})
            if self.stand_in is not None:
                self.stand_in.pending = stand_ins[int(rows[0])]
        return given


def _rows_of(name: str, value: Tensor, rows: Tensor) -> Tensor:
    """``rows`` of a by-row input: M-RoPE positions (held rows first) back in the model's layout."""
    held = value[rows.to(value.device)]
    return held.transpose(0, 1) if name == "position_ids" else held
