"""What the strategy may ask of a LightningModule beyond Lightning's own interface, as a protocol: a module that
answers it (:class:`~lightning_automodel.CausalLMModule` does) is planned for as it computes; any other is taken to
compute as a plain Hugging Face model does."""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class ModuleHints(Protocol):
    @property
    def loss_chunks(self) -> int:
        """The sequence chunks the module computes its head and loss in (1: the logits whole), which the activation
        memory of ``layout="auto"`` and ``lightning-automodel plan`` counts one of."""
        ...


def loss_chunks_of(module: object) -> int:
    """The module's :attr:`ModuleHints.loss_chunks`, or 1 (the logits whole) where it gives none."""
    return module.loss_chunks if isinstance(module, ModuleHints) else 1
