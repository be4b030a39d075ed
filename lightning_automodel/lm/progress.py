"""Lightning's progress bar, counting a run bounded by ``max_steps`` in optimizer steps.

Lightning's bars count the batches of the current epoch under the epoch's number. A run bounded by
``Trainer(max_steps=...)`` has ``max_epochs=-1``, which the rich bar prints as "Epoch 0/-2"; its count starts
again at every epoch, and after a resume or with gradient accumulation it counts batches, not steps. Here such a
run reads "Step  120/150": ``global_step`` of ``max_steps``, across epochs and resumes. A run bounded by epochs
keeps Lightning's bar.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar

_DESCRIPTION = "Step"


class StepProgressBar(RichProgressBar):
    """``RichProgressBar`` whose training bar shows ``global_step/max_steps`` in a run bounded by ``max_steps``.

    The ``lightning-automodel`` command uses it unless the config brings a progress bar of its own or turns the bar
    off; in a script, pass it to the Trainer: ``L.Trainer(callbacks=[StepProgressBar()], ...)``.
    """

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self._show_steps(trainer)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._show_steps(trainer)

    def _show_steps(self, trainer: L.Trainer) -> None:
        """Lightning has just set the training bar to the epoch's batches: set it to the run's steps."""
        if not _bounded_by_steps(trainer) or self.progress is None or self.train_progress_bar_id is None:
            return
        style = self.theme.description
        description = f"{_DESCRIPTION:{len(self.validation_description)}}"  # aligned with the validation bar
        self.progress.update(
            self.train_progress_bar_id,
            description=f"[{style}]{description}" if style else description,
            total=trainer.max_steps,
            completed=trainer.global_step,
        )
        self.refresh()


def _bounded_by_steps(trainer: L.Trainer) -> bool:
    """Whether ``max_steps`` alone ends the run (Lightning then sets ``max_epochs`` to -1)."""
    return trainer.max_steps > 0 and trainer.max_epochs == -1
