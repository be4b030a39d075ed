"""What the strategy may ask of a LightningModule beyond Lightning's own interface, as protocols: a module that
answers them (:class:`~lightning_automodel.CausalLMModule` does) is planned for as it computes; any other is taken to
compute as a plain Hugging Face model does, and to step torch's AdamW as torch does on GPUs (foreach)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from lightning_automodel.planning.memory.optimizer_step import AdamWImplementation


@runtime_checkable
class ModuleHints(Protocol):
    @property
    def loss_chunks(self) -> int:
        """The sequence chunks the module computes its head and loss in (1: the logits whole), which the activation
        memory of ``layout="auto"`` and ``lightning-automodel plan`` counts one of."""
        ...


@runtime_checkable
class OptimizerHints(Protocol):
    @property
    def adamw(self) -> AdamWImplementation:
        """How the module's AdamW steps, whose temporaries ``layout="auto"`` and ``lightning-automodel plan`` count
        (see :mod:`~lightning_automodel.planning.memory.optimizer_step`)."""
        ...


def loss_chunks_of(module: object) -> int:
    """The module's :attr:`ModuleHints.loss_chunks`, or 1 (the logits whole) where it gives none."""
    return module.loss_chunks if isinstance(module, ModuleHints) else 1


def adamw_of(module: object) -> AdamWImplementation:
    """The module's :attr:`OptimizerHints.adamw`, or foreach (torch's default on GPUs) where it gives none."""
    return module.adamw if isinstance(module, OptimizerHints) else "foreach"
