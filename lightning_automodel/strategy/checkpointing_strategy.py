"""The strategy's checkpoint hooks: saves that appear whole or not at all and replace nothing a user wrote (written
while training goes on with ``async_save``), loads that check the checkpoint first (sharded, or Lightning's single
file from any run: one device, DDP) and reshard it to this run's layout, and every rank's random states.

Random states: restored at the load, before the loader's iterator is made (its base seed is a draw), so that a
resume at an epoch's end draws what the uninterrupted run drew when it began the next epoch; and again as
training starts when the resumed epoch has batches left, where the uninterrupted run made no new iterator.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_automodel.io.async_save import AsyncSaver
from lightning_automodel.io.atomic_directory import atomic_directory, check_save_path, readable_path
from lightning_automodel.io.lightning_checkpoint import (
    check_checkpoint,
    explain_save_failure,
    load_checkpoint,
    not_checkpoint_files,
    only_trainable,
    split_packed,
)
from lightning_automodel.io.random_states import RandomStates, gather_random_states, restore_random_states
from lightning_automodel.strategy.faults.preemption import Preemption
from lightning_automodel.strategy.options import StrategyOptions

if TYPE_CHECKING:
    import lightning.pytorch as pl

RANDOM_STATES = "random_states"


class CheckpointingStrategy(ModelParallelStrategy):
    options: StrategyOptions
    _preemption: Preemption | None = None
    _async_saver: AsyncSaver | None = None  # made at the first asynchronous save of a stage
    _random_states: list[RandomStates] | None = None  # loaded, until training starts

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = super().lightning_module_state_dict()
        state = only_trainable(state, self.model) if self.options.save_trainable_only else state
        return split_packed(state) if self._save_distributed_checkpoint else state

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        state = super().optimizer_state(optimizer)
        return split_packed(state) if self._save_distributed_checkpoint else state

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Sharded checkpoints are written beside their path and swapped in once every rank has written its part:
        a save that fails midway (a full disk, a killed job) leaves the previous checkpoint at that path whole.

        A save replaces a previous checkpoint at its path and nothing else: a path holding other files (a user's
        folder, a dataset) is refused on every rank, where the parent would delete them or write among them."""
        path = Path(self.broadcast(filepath))
        checkpoint = {**checkpoint, RANDOM_STATES: gather_random_states()}
        if self.options.async_save:
            self._save_asynchronously(checkpoint, path)
        elif not self._save_distributed_checkpoint:
            check_save_path(path, unowned=not_checkpoint_files)
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
        else:
            with atomic_directory(path, unowned=not_checkpoint_files) as staging, explain_save_failure(path):
                super().save_checkpoint(checkpoint, staging, storage_options=storage_options)
        if self._preemption is not None:  # a signal that came during the save stops the job now
            self._preemption.saved(path)

    def _save_asynchronously(self, checkpoint: dict[str, Any], path: Path) -> None:
        if self._async_saver is None:
            self._async_saver = AsyncSaver(timeout=self._timeout, pinned=self.root_device.type == "cuda")
        state = {"state_dict": checkpoint.pop("state_dict")}  # as the parent lays a sharded checkpoint out
        optimizers = checkpoint.pop("optimizer_states", [])
        state.update({f"optimizer_{index}": optimizer for index, optimizer in enumerate(optimizers)})
        self._async_saver.save(state, checkpoint, path, unowned=not_checkpoint_files)

    def wait_for_saves(self) -> None:
        """Until the asynchronous save in flight is in place; its failure, on any rank, raises on every rank
        (collective). Saves, loads and the end of a stage wait on their own."""
        if self._async_saver is not None:
            self._async_saver.wait()

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        """With a save in flight, the removal (of an older checkpoint) waits for it in the background, and is not
        done if the save fails."""
        remove = super().remove_checkpoint
        if self._async_saver is None:
            remove(filepath)
        else:
            self._async_saver.then(lambda: remove(filepath))

    def _close_saves(self, *, collective: bool) -> None:
        """At the end of a stage: the save in flight in place, its failure raised on every rank (``collective``),
        or, where this rank stops alone, said on this rank."""
        saver, self._async_saver = self._async_saver, None
        if saver is not None:
            saver.close(collective=collective)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        self.wait_for_saves()
        path = Path(self.broadcast(str(readable_path(Path(checkpoint_path)))))
        check_checkpoint(path)
        assert self.lightning_module is not None and self.model is not None
        checkpoint = load_checkpoint(
            path,
            self.model,
            self.optimizers,
            trainable_only=self.options.save_trainable_only,
            strict=self.lightning_module.strict_loading,
            weights_only=weights_only,
        )
        self._random_states = self._restorable(checkpoint.pop(RANDOM_STATES, None), path)
        if self._random_states is not None:
            restore_random_states(self._random_states)
        return checkpoint

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        assert self.lightning_module is not None
        if self._random_states is not None and _batches_left(self.lightning_module.trainer):
            restore_random_states(self._random_states)
        self._random_states = None

    def _restorable(self, saved: list[RandomStates] | None, path: Path) -> list[RandomStates] | None:
        """``saved`` if it can be restored into this run: a fit on as many processes as saved it."""
        assert self.lightning_module is not None
        if self.lightning_module.trainer.state.fn != TrainerFn.FITTING:
            return None
        if saved is None or len(saved) != self.world_size:
            found = "no random states" if saved is None else f"the random states of {len(saved)} processes"
            rank_zero_warn(
                f"{path} holds {found} and this run has {self.world_size}: they are not restored, so what a step"
                " draws (dropout) differs from the uninterrupted run."
            )
            return None
        return saved


def _batches_left(trainer: pl.Trainer) -> bool:
    """Whether the epoch a resumed run goes on with has batches left (it resumed mid-epoch)."""
    return trainer.fit_loop.epoch_loop.batch_progress.current.ready < trainer.fit_loop.max_batches
