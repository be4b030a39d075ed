"""What a measured training step needs beside the layout it is measured at, as one frozen value: the search passes
it to every worker (a child process too) unchanged."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_automodel.parallel.chunked_loss import check_loss_chunks
from lightning_automodel.parallel.context_parallel import CPAttention
from lightning_automodel.parallel.options import ParallelOptions
from lightning_automodel.parallel.tensor.plans.selection import PlanSpec
from lightning_automodel.planning.memory.optimizer_step import AdamWImplementation, check_adamw
from lightning_automodel.planning.memory.routing import ExpertRouting


@dataclass(frozen=True)
class StepOptions:
    """How a candidate layout's step is parallelized and computed, where the candidate does not say (its sizes,
    sequence parallel, checkpointing and pipeline are its own): as the strategy's options and the LightningModule
    set them."""

    tp_plan: PlanSpec | None = None
    """The strategy's ``tp_plan`` (None: the plan the model gets)."""

    allow_unsharded_linears: bool = False
    """The strategy's ``allow_unsharded_linears``."""

    mp_policy: MixedPrecisionPolicy | None = None
    """FSDP2's mixed precision, as the strategy takes it from the Trainer's precision (None: the weights' dtype)."""

    cp_attention: CPAttention = "auto"
    """The strategy's ``cp_attention`` (the estimate counts SDPA's dense mask under any)."""

    loss_chunks: int = 1
    """The sequence chunks the LightningModule computes its head and loss in (1: the logits whole)."""

    freeze: tuple[str, ...] = ()
    """The strategy's ``freeze``: frozen parameters hold no gradient and no AdamW state, and a frozen vision tower
    saves no activation for backward (see :func:`~lightning_automodel.hf.freezing.freeze`)."""

    images_per_row: int | None = None
    """A vision-language model's images a row (None: one; 0: a text-only step), whose pixels the step runs through the
    tower (see :mod:`~lightning_automodel.planning.memory.step_images`). Refused for a model that takes none."""

    image_tokens: int | None = None
    """The tokens an image, for a tower that takes images of any size (Qwen2-VL's; None: 256); others' are their
    config's."""

    expert_imbalance: float = 1.0
    """A mixture-of-experts model's routing: the busiest expert's share of a rank's choices relative to a balanced
    one (1: balanced; see :class:`~lightning_automodel.planning.memory.routing.ExpertRouting`)."""

    adamw: AdamWImplementation = "foreach"
    """How the LightningModule's AdamW steps, whose temporaries the estimate counts (see
    :mod:`~lightning_automodel.planning.memory.optimizer_step`)."""

    def __post_init__(self) -> None:
        check_loss_chunks(self.loss_chunks)
        check_adamw(self.adamw)
        check_images(images_per_row=self.images_per_row, image_tokens=self.image_tokens)
        ExpertRouting(self.expert_imbalance)  # refused here, where it is given

    @classmethod
    def of(
        cls,
        parallel: ParallelOptions,
        *,
        mp_policy: MixedPrecisionPolicy | None,
        loss_chunks: int,
        adamw: AdamWImplementation = "foreach",
        images: tuple[int | None, int | None] = (None, None),
        expert_imbalance: float | None = None,
    ) -> StepOptions:
        """The step options of the strategy's ``parallel`` options, with FSDP2's ``mp_policy`` resolved for the
        Trainer's precision, the LightningModule's ``loss_chunks`` and ``adamw``, the ``images`` (a row's, tokens
        each) and ``expert_imbalance`` (None: balanced) planned for."""
        return cls(
            tp_plan=parallel.tp_plan,
            allow_unsharded_linears=parallel.allow_unsharded_linears,
            mp_policy=mp_policy,
            cp_attention=parallel.cp_attention,
            loss_chunks=loss_chunks,
            adamw=adamw,
            freeze=parallel.freeze,
            images_per_row=images[0],
            image_tokens=images[1],
            expert_imbalance=1.0 if expert_imbalance is None else expert_imbalance,
        )

    def images(self) -> dict[str, int | None]:
        """The images a row and tokens an image, as keyword arguments of
        :func:`~lightning_automodel.planning.memory.step_images.step_images`."""
        return {"images_per_row": self.images_per_row, "image_tokens": self.image_tokens}

    def keywords(self) -> dict[str, Any]:
        """These options as keyword arguments of
        :func:`~lightning_automodel.planning.memory.activations.activation_bytes`."""
        return {field.name: getattr(self, field.name) for field in fields(self) if field.name != "adamw"}

    def optimizer_keywords(self) -> dict[str, Any]:
        """These options as keyword arguments of
        :func:`~lightning_automodel.planning.memory.optimizer_step.optimizer_step_bytes`: the AdamW and how the model
        is parallelized."""
        stepped = ("loss_chunks", "images_per_row", "image_tokens", "expert_imbalance")
        parallel = {name: value for name, value in self.keywords().items() if name not in stepped}
        return {"implementation": self.adamw, **parallel}


def check_images(*, images_per_row: int | None, image_tokens: int | None, prefix: str = "") -> None:
    """Refuse images a row and tokens an image that are not counts (``prefix``: the option's, as the user gave it)."""
    for name, value, least in (("images_per_row", images_per_row, 0), ("image_tokens", image_tokens, 1)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            raise ValueError(f"{prefix}{name}={value!r}: an integer of at least {least} (or None).")
