"""Sharded checkpoints written while training goes on, with the guarantees of a synchronous save.

``dcp.async_save`` copies each rank's shards to CPU memory (pinned on GPUs), which is all the training step waits
for, then writes them from a thread, over a gloo process group of its own (two threads' collectives on one group
would interleave). Torch's coordinator writes the checkpoint's index only once every rank's shards are written, so
when rank 0's write completes, rank 0 swaps the staging directory into place as a synchronous save does (see
:mod:`~lightning_automodel.io.atomic_directory`). One save is in flight at a time: the next save, a load and the end
of the stage wait for it, and a failed write, of any rank, is raised there on every rank; a removal of an older
checkpoint (ModelCheckpoint's top-k) waits in the writer thread until the new one is in place.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.load import _METADATA_FILENAME
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from lightning_automodel.io.atomic_directory import Unowned, put_in_place, staging_directory
from lightning_automodel.io.lightning_checkpoint import explain_save_failure, raise_everywhere


class AsyncSaver:
    """The asynchronous saves of one stage. Collective: make it, and call every method, on every rank."""

    def __init__(self, *, timeout: timedelta | None, pinned: bool) -> None:
        """``pinned``: stage in pinned memory with non-blocking copies (the shards are on a GPU)."""
        self._group = dist.new_group(backend="gloo", timeout=timeout) if dist.is_initialized() else None
        self._stager = DefaultStager(StagingOptions(pinned, False, False, pinned))
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning-automodel-save")
        self._pending: tuple[Path, Future] | None = None

    def save(self, state: dict[str, Any], metadata: dict[str, Any], target: Path, *, unowned: Unowned) -> None:
        """Start saving ``state`` (the tensors, sharded) and ``metadata`` (Lightning's ``meta.pt``, rank 0's) as the
        checkpoint ``target``; returns once the shards are copied."""
        self.wait()
        staging = staging_directory(target, unowned=unowned)
        problem = None
        if not dist.is_initialized() or dist.get_rank() == 0:
            try:
                with explain_save_failure(target):
                    torch.save(metadata, staging / _METADATA_FILENAME)
            except Exception as error:
                put_in_place(target, staging, unowned=unowned, written=False)
                problem = error
        raise_everywhere(problem)  # before the writer threads meet in their collectives
        upload = dcp.async_save(state, checkpoint_id=staging, process_group=self._group, async_stager=self._stager)
        self._pending = (target, self._writer.submit(_finish, upload, target, staging, unowned))

    def then(self, action: Callable[[], None]) -> None:
        """Run ``action`` on this rank once the save in flight is in place, and not if it fails (the removal of an
        older checkpoint must not leave fewer complete ones than before); at once if none is in flight."""
        if self._pending is None:
            action()
            return
        target, saving = self._pending
        self._pending = (target, self._writer.submit(_after, saving, action))

    def wait(self, *, collective: bool = True) -> None:
        """Until the save in flight is in place; a failure on any rank raises on every rank (``collective``), or,
        where this rank stops alone, is said on this rank."""
        if self._pending is None:
            return
        target, finished = self._pending
        self._pending = None
        problem = None
        try:
            with explain_save_failure(target):
                finished.result()
        except Exception as error:
            problem = error
        if collective:
            raise_everywhere(problem)
        elif problem is not None:
            print(f"lightning-automodel: {problem}", file=sys.stderr, flush=True)

    def close(self, *, collective: bool = True) -> None:
        try:
            self.wait(collective=collective)
        finally:
            self._writer.shutdown()
            self._stager.close()


def _after(saving: Future, action: Callable[[], None]) -> None:
    saving.result()  # a failed save raises here: the action does not run
    action()


def _finish(upload: Future, target: Path, staging: Path, unowned: Unowned) -> None:
    """In the writer thread: wait for this rank's shards (and, on rank 0, every rank's), then swap on rank 0."""
    written = False
    try:
        upload.result()
        written = True
    finally:
        if not dist.is_initialized() or dist.get_rank() == 0:
            put_in_place(target, staging, unowned=unowned, written=written)
