"""What the plan report says of a vision-language model's vision tower and projector: their parameters (in all and
those a rank holds), how they are sharded, the images the activation estimate's step carries and what they add to
its peak."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.tensor import DTensor

from lightning_automodel.hf.decoder_layers import named_decoder_layers, named_multimodal_parts
from lightning_automodel.parallel.mesh import ParallelDims
from lightning_automodel.planning.memory.step_images import StepImages


@dataclass
class TowerReport:
    """A vision tower and projector in a plan."""

    parts: dict[str, int]  # name -> parameters
    blocks: int  # the blocks among them
    split: int = 0  # under tp: the plan's styles for their projections
    kept: dict[str, str] = field(default_factory=dict)  # under tp: what stays whole on every tp rank, and why
    per_rank: int = 0  # their parameters a rank holds (its local shards)
    images: StepImages | None = None  # what each row of the activation estimate's step holds
    activation_bytes: dict[str, int] = field(default_factory=dict)  # checkpointing mode -> what the images add

    @classmethod
    def of(cls, model: nn.Module) -> TowerReport | None:
        """``model``'s tower and projector, None for a model without (a text model)."""
        parts = named_multimodal_parts(model)
        if not parts:
            return None
        beside = tuple(f"{name}." for name, _ in parts)
        blocks = sum(name.startswith(beside) for name, _ in named_decoder_layers(model))
        return cls({name: sum(p.numel() for p in part.parameters()) for name, part in parts}, blocks)

    def count_per_rank(self, model: nn.Module) -> None:
        """Count the parameters of the parts that ``model`` (parallelized) holds on this rank."""
        beside = tuple(f"{name}." for name in self.parts)
        held = [p for name, p in model.named_parameters() if name.startswith(beside)]
        self.per_rank = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in held)

    def line(self, dims: ParallelDims, *, total_parameters: int, parameters_per_rank: int) -> str:
        """The report's line: the parts, their share of the parameters in all and on a rank, and how they are
        sharded."""
        held = sum(self.parts.values())
        parts = ", ".join(f"{name} ({count:,})" for name, count in self.parts.items())
        line = (
            f"vision tower and projector: {parts}, {held / max(total_parameters, 1):.1%} of the parameters;"
            f" {self.per_rank:,} per rank ({self.per_rank / max(parameters_per_rank, 1):.1%} of the rank's);"
            f" FSDP2 units of their own ({self.blocks} blocks, then the rest of each part)"
        )
        if dims.tp == 1:
            return line
        if self.split:
            line += (
                f"; tp splits {self.split} of their projections (entries column-, exits row-parallel,"
                " checked by the probe's step with images; the tower's activations are not sequence-parallel)"
            )
        by_reason: dict[str, list[str]] = {}
        for name, why in self.kept.items():
            by_reason.setdefault(why, []).append(per_block(name))
        kept = "; ".join(f"{', '.join(dict.fromkeys(names))} ({why})" for why, names in by_reason.items())
        if not kept:
            return line
        return (
            f"{line}; kept whole on every tp rank: {kept} (every tp rank computes their whole gradient from the same"
            " images; FSDP2 averages it over the data-parallel ranks)"
        )

    def step_line(self) -> str:
        """What the activation estimate's step holds of images."""
        if self.images is None:
            return (
                "no images in the step (images_per_row=0, or a config without the image placeholder and pixel sizes"
                " to build images from): the tower's activations are not counted"
            )
        return (
            f"{self.images} (images_per_row=, image_tokens=): the tower's activations and the image tokens counted;"
            " 'images' is what they add to the peak of rows of text alone"
        )


def per_block(name: str) -> str:
    """``name`` with its block indices as ``*``."""
    return re.sub(r"\.\d+\.", ".*.", name)
