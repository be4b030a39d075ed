"""A data-parallel rank whose batch holds no image runs the vision tower all the same when another rank's does.

FSDP2 gathers a unit's weights when the unit runs and reduces its gradients after the unit's backward, each a
collective of every rank that shards it. A vision-language model runs its tower only for the images in the batch, so
a rank without images would leave the other ranks' gathers unmatched: the step fails (gloo: "Connection reset by
peer") or hangs (NCCL). Each forward the ranks agree whether any of them has images (one flag, all-reduced); a rank
without them then runs the tower on a stand-in image where the model would (before the language model) and adds
its features times zero to the language model's input embeddings. Its gathers and reductions come in the others'
order, and its share of the tower's gradient is zero, as a rank's share is for a token it does not hold.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_flatten

from lightning_automodel.hf.vision.image_inputs import builds_images, model_pixels


def run_tower_on_every_rank(model: nn.Module, mesh: DeviceMesh) -> None:
    """Hook ``model`` (a vision-language model, sharded by FSDP2 over ``mesh``'s ranks) so that every rank of
    ``mesh`` runs its tower in a forward where any of them has images. A model whose stand-in image
    :mod:`~lightning_automodel.hf.vision.image_inputs` cannot build is refused in such a forward, on every rank."""
    stand_in = TowerStandIn(model, mesh)
    signature = inspect.signature(model.forward)

    def agree(module: nn.Module, args: tuple, kwargs: dict) -> None:
        arguments = signature.bind_partial(*args, **kwargs).arguments
        stand_in.pending = stand_in.needed([_has_images({**arguments.pop("kwargs", {}), **arguments})])[0]

    model.register_forward_pre_hook(agree, with_kwargs=True)


class TowerStandIn:
    """The vision tower of ``model`` run on a stand-in image, its features times zero added to the language model's
    input embeddings, in a forward where :attr:`pending` (reset there). Under pipeline parallel each micro-batch of
    the first stage sets it (see :mod:`lightning_automodel.parallel.pipeline.images`)."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, *, pixels: dict[str, torch.Tensor] | None = None) -> None:
        """``pixels``: the stand-in image's inputs (default: :func:`stand_in_pixels`, read off the model's config and
        forward, which pipeline parallel replaces: it passes those found before)."""
        self.model = model
        self.group = mesh.get_group()
        self.device_type = mesh.device_type
        self.pixels = stand_in_pixels(model) if pixels is None else pixels
        self.pending = False
        # First among the language model's hooks: before tensor parallel turns its input into a DTensor.
        model.get_decoder().register_forward_pre_hook(self._add_features, with_kwargs=True, prepend=True)

    def needed(self, here: list[bool]) -> list[bool]:
        """Whether this rank runs the stand-in in each of ``here``'s forwards (whether it has images in each): where
        some ranks of the group have images and it has none. One all-reduce of the group."""
        flags = torch.tensor([[float(has), float(not has)] for has in here], device=self.device_type)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        mixed = flags.min(-1).values.bool().tolist()  # some ranks with images, some without
        if any(mixed) and not self.pixels:
            raise ValueError(
                f"{type(self.model).__name__}: some data-parallel ranks' batches hold images and others' none, and"
                " its config gives no image placeholder or pixel sizes to run the vision tower on a stand-in image"
                " where a batch has none (FSDP2 needs every rank to run it). Give every batch an image, or none."
            )
        return [some and not has for some, has in zip(mixed, here, strict=True)]

    def _add_features(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not self.pending:
            return None
        self.pending = False
        embeds = kwargs.get("inputs_embeds")
        if not isinstance(embeds, torch.Tensor):
            raise RuntimeError(
                f"{type(self.model).__name__}: its language model got no inputs_embeds tensor to carry the stand-in"
                " image of a rank whose batch holds no image."
            )
        pixels = {name: value.to(embeds.device) for name, value in self.pixels.items()}
        features = self.model.get_image_features(**pixels)
        zero = sum(leaf.float().sum() for leaf in tree_flatten(features)[0] if isinstance(leaf, torch.Tensor)) * 0
        return args, {**kwargs, "inputs_embeds": embeds + zero.to(embeds.dtype)}


def stand_in_pixels(model: nn.Module) -> dict[str, torch.Tensor]:
    """One image's pixels for ``model``'s ``get_image_features``, in its layout; none where it has none, its config
    gives no image placeholder and sizes, or it needs more than pixels (InstructBLIP's instruction for its Q-Former):
    a batch without images beside others with them is refused."""
    get_features = getattr(model, "get_image_features", None)
    if get_features is None or not builds_images(model):
        return {}
    pixels = model_pixels(model, images=1)
    required = {
        name
        for name, parameter in inspect.signature(get_features).parameters.items()
        if parameter.default is parameter.empty
        and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
    }
    return pixels if required <= set(pixels) else {}


def _has_images(arguments: dict[str, Any]) -> bool:
    pixels = arguments.get("pixel_values")
    return isinstance(pixels, torch.Tensor) and pixels.numel() > 0
