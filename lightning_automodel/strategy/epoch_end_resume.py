"""Resume from a checkpoint saved between two epochs as the uninterrupted run goes on, and from any checkpoint with
the sampler's epoch set before the training loader's iterator is made (docs/checkpoints.md, "Resume positions").

A checkpoint is saved between epochs once the epoch's last batch is trained: at that batch's end
(``ModelCheckpoint(every_n_train_steps=k)`` where k divides the epoch), at the epoch's end (``every_n_epochs``,
Lightning's default checkpoint) or after the epoch's validation. Lightning 2.6 resumes from it by restarting the
epoch as if it were unfinished. From a ``StatefulDataLoader`` saved at the last batch it restores an exhausted
iterator: the next epoch is empty, and ``current_epoch`` and the shuffle run one epoch ahead. Under ``max_steps``,
from an epoch's end, it trains one more batch as the finished epoch's (``batch_idx`` equal to the epoch's length)
and then starts the next epoch one sampler epoch late. Here the checkpoint's loops are brought to where the
uninterrupted run's stand once that epoch has ended, and the fit loop starts the next epoch without a restart, as
the uninterrupted run does (a new iterator, the loader's saved state not loaded).

Lightning also makes the training loader's iterator before it sets the sampler's epoch, and a ``StatefulDataLoader``
draws its sampler's order at once: torch's ``DistributedSampler`` deals epoch 0's order again. And when
``configure_optimizers`` reads ``trainer.estimated_stepping_batches`` under ``max_epochs`` (``CausalLMModule``'s
schedule does), Lightning builds that loader before the loops are restored and never loads its saved position.
Here the sampler's epoch is set as the loader is prepared, and a loader built before the load is built again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.loops.loop import _Loop
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

if TYPE_CHECKING:
    from lightning.pytorch.loops import _FitLoop


def between_epochs(fit_loop: dict[str, Any]) -> bool:
    """Whether a saved fit loop stands after its epoch's last batch was trained (Lightning's own flag: the loader
    said the batch was its last, and that batch's step ran)."""
    batches = fit_loop["epoch_loop.batch_progress"]
    return batches["is_last_batch"] and 0 < batches["current"]["ready"] == batches["current"]["processed"]


def end_epoch(fit_loop: dict[str, Any]) -> dict[str, Any]:
    """The saved fit loop as the uninterrupted run holds it once the epoch has ended: the epoch processed and
    completed, its last batch completed, and the logging step counted for that batch where the save came before
    the count (at the batch's end, or after the validation that follows it)."""
    epochs = fit_loop["epoch_progress"]
    counted = epochs["total"]["processed"] == epochs["total"]["started"]  # saved at on_train_epoch_end
    batches = fit_loop["epoch_loop.batch_progress"]
    stepped = fit_loop["epoch_loop.state_dict"]["_batches_that_stepped"]
    return {
        **fit_loop,
        "epoch_progress": {part: _all_at(counts["started"]) for part, counts in epochs.items()},
        "epoch_loop.batch_progress": {
            **batches,
            **{part: {**batches[part], "completed": batches[part]["processed"]} for part in ("current", "total")},
        },
        "epoch_loop.state_dict": {
            **fit_loop["epoch_loop.state_dict"],
            "_batches_that_stepped": stepped if counted else stepped + 1,
        },
    }


def _all_at(count: int) -> dict[str, int]:
    return {"ready": count, "started": count, "processed": count, "completed": count}


def _forget_training_loader(fit_loop: _FitLoop) -> None:
    """Make Lightning build the training loader again when fit starts: built before the loops were restored, it
    began at the sampler's epoch 0 and never loaded the saved position. Lightning offers no call for it."""
    if fit_loop._combined_loader is not None:
        fit_loop.teardown()
        fit_loop._combined_loader = None


class EpochEndResume(Strategy):
    """A strategy mixin (first among the bases) that resumes exactly from a checkpoint saved at an epoch's last
    batch or end, and sets the training sampler's epoch before the loader's iterator exists. It works for any
    Lightning strategy; the checkpoint is restored after ``setup``, so that a loader built during setup is built
    again once the loops are restored."""

    _starts_next_epoch = False  # the loaded checkpoint's epoch has ended: the fit loop must not restart

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        if trainer.state.fn != TrainerFn.FITTING:
            return checkpoint
        _forget_training_loader(trainer.fit_loop)
        fit_loop = checkpoint.get("loops", {}).get("fit_loop")
        self._starts_next_epoch = fit_loop is not None and between_epochs(fit_loop)
        if self._starts_next_epoch:
            checkpoint["loops"]["fit_loop"] = end_epoch(fit_loop)
        return checkpoint

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """The training loader, as Lightning prepares it (before its iterator is made and its saved state loaded):
        its sampler at the epoch the loop trains next, and after a checkpoint saved between epochs, no restart."""
        dataloader = super().process_dataloader(dataloader)
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        if trainer.state.fn == TrainerFn.FITTING and trainer.training:
            _set_sampler_epoch(dataloader, trainer.fit_loop.epoch_progress.current.processed)
            if self._starts_next_epoch:  # the fit loop's own setter keeps restarting under max_steps
                _Loop.restarting.fset(trainer.fit_loop, False)
                self._starts_next_epoch = False
        return dataloader
