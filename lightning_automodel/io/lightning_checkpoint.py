"""Lightning's checkpoints under the strategy: loaded, sharded or a single file, into any layout after checking that
they fit; saved into paths that hold nothing else, with failures explained.

A LoRA run trains a few million parameters on top of billions of frozen ones that never change and can be
rebuilt from where they came from (the pretrained checkpoint, or the seed): saving them at every checkpoint
costs disk and time for nothing, so a checkpoint may hold the trainable parameters only. And an optimizer has no
state for a parameter that never got a gradient (a vision tower in text-only training), so its saved state lacks
entries that a freshly set-up optimizer has.
"""

from __future__ import annotations

import shutil
import zipfile
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist
from lightning.fabric.strategies.fsdp import _is_sharded_checkpoint
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from lightning_automodel.hf.packed_weights import is_packed, packed_blocks
from lightning_automodel.io.atomic_directory import unowned_entries
from lightning_automodel.io.checkpoint_contents import Held, Stored, misfit
from lightning_automodel.io.full_checkpoint import FullCheckpoint
from lightning_automodel.io.sharded_checkpoint import ShardedCheckpoint

T = TypeVar("T")


def not_checkpoint_files(path: Path) -> list[str]:
    """What stands at ``path`` that is not a Lightning checkpoint, so a save there must not replace it: anything
    but a sharded checkpoint's files (``meta.pt``, ``.metadata``, ``*.distcp``) or a single-file checkpoint."""
    if path.is_file() and not path.is_symlink():
        return [] if _is_torch_save(path) else [path.name]
    return unowned_entries(path, owned=lambda entry: entry.name in _SHARDED_FILES or entry.suffix == ".distcp")


_SHARDED_FILES = (_METADATA_FILENAME, ".metadata")


def _is_torch_save(path: Path) -> bool:
    """Whether ``path`` is a file written by ``torch.save`` (a zip archive holding a ``data.pkl``)."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(name.endswith("/data.pkl") for name in archive.namelist())


def split_packed(tree: Any) -> Any:
    """``tree`` (a state dict, possibly nested) with every packed weight replaced by its blocks (see
    :func:`~lightning_automodel.hf.packed_weights.packed_blocks`): torch's distributed checkpoint refuses strided
    shards ("overlapping chunks"). The blocks share the weights' storage, so loading into them loads the weights."""
    if isinstance(tree, dict):
        return {key: split_packed(value) for key, value in tree.items()}
    return packed_blocks(tree) if is_packed(tree) else tree


def only_trainable(state_dict: dict[str, Any], module: nn.Module) -> dict[str, Any]:
    trainable = {name for name, param in module.named_parameters() if param.requires_grad}
    return {name: value for name, value in state_dict.items() if name in trainable}


def load_checkpoint(
    path: Path,
    module: nn.Module,
    optimizers: list[Optimizer],
    *,
    trainable_only: bool = False,
    strict: bool = True,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Load a Lightning checkpoint, sharded or a single file (what one device, DDP or any layout saved), into
    ``module`` and ``optimizers``, resharded to their layout. Returns the checkpoint's other contents (loop state,
    callbacks), as Lightning does. Refused on every rank before the load's first collective when it does not fit
    (see :func:`~lightning_automodel.io.checkpoint_contents.misfit`).

    ``trainable_only``: the checkpoint holds the trainable parameters only; frozen ones stay as built. ``strict``
    (the LightningModule's ``strict_loading``): what one side holds and the other lacks is an error; without it,
    what both hold is loaded.
    """
    whole_state = get_model_state_dict(module)
    model_state = only_trainable(whole_state, module) if trainable_only else whole_state
    optimizer_states = [get_optimizer_state_dict(module, optimizer) for optimizer in optimizers]
    held = Held.of(model_state, optimizer_states, kept=frozenset(whole_state.keys() - model_state.keys()))
    reader, stored = _open_fitting(path, held, strict=strict, weights_only=weights_only)
    reader.load_weights(model_state, strict=strict)
    set_model_state_dict(module, model_state, options=StateDictOptions(strict=strict and not trainable_only))
    for index, (optimizer, state) in enumerate(zip(optimizers, optimizer_states, strict=True)):
        unloadable = stored.unloadable(index)
        if unloadable is not None:  # strict refused it: the user asked for what can be loaded
            rank_zero_warn(f"{path}: optimizer {index}'s state is not loaded and starts fresh: {unloadable}.")
            continue
        _load_optimizer(reader, stored, index, module, optimizer, state)
    return reader.metadata()


def _open_fitting(
    path: Path, held: Held, *, strict: bool, weights_only: bool | None
) -> tuple[ShardedCheckpoint | FullCheckpoint, Stored]:
    """The checkpoint at ``path`` opened and what it holds, once every rank has found that it can be read and fits
    what the ranks hold (``held``: this rank's); otherwise the first rank's reason raised on every rank."""
    reader, problem = _open(path, weights_only=weights_only)
    gathered = gather_everywhere((held, problem))
    unreadable = next((found for _, found in gathered if found is not None), None)
    if unreadable is not None:  # every rank gathered the same
        raise unreadable
    assert reader is not None
    held_by_rank = [rank for rank, _ in gathered]
    stored = reader.contents(held_by_rank)
    raise_everywhere(misfit(path, stored, held_by_rank, strict=strict))
    return reader, stored


def _load_optimizer(
    reader: ShardedCheckpoint | FullCheckpoint,
    stored: Stored,
    index: int,
    module: nn.Module,
    optimizer: Optimizer,
    state: dict[str, Any],
) -> None:
    """Load ``optimizer``'s state (``state``: this run's, by parameter name) and each param group's settings by the
    group's position: a checkpoint holds the groups' parameter names as one rank saved them, and under pp the ranks
    hold other parameters (torch, matching groups by those names, would give a group none of its settings)."""
    settings = reader.load_optimizer(index, state, stored=stored)
    set_optimizer_state_dict(module, optimizer, optim_state_dict=state, options=StateDictOptions(cpu_offload=True))
    for group, saved in zip(optimizer.param_groups, settings, strict=False):  # a partial load: fewer or more
        group.update(saved)


def _open(
    path: Path, *, weights_only: bool | None
) -> tuple[ShardedCheckpoint | FullCheckpoint | None, Exception | None]:
    """The checkpoint at ``path`` opened, or why it cannot be: said on every rank, not raised on one."""
    try:
        if _is_sharded_checkpoint(path):
            return ShardedCheckpoint(path, weights_only=weights_only), None
        return FullCheckpoint(path, weights_only=weights_only), None
    except ValueError as error:
        return None, error
    except Exception as error:
        return None, ValueError(
            f"{path} cannot be read ({type(error).__name__}: {error}). Resume from an earlier checkpoint."
        )


def check_checkpoint(path: Path) -> None:
    """Raise on every rank, naming the file, if ``path`` is missing or a sharded checkpoint there is incomplete or
    damaged (a shard missing or shorter than the checkpoint's index says); collective. Without it, a rank that
    cannot read its shard fails inside torch's loader, with the file's name deep in a traceback or not at all."""
    raise_everywhere(_damage(path))


def raise_everywhere(problem: Exception | None) -> None:
    """Raise the first rank's ``problem`` on every rank; collective. A rank that raised alone would leave the others
    waiting in the next collective (shared file systems can show ranks different files)."""
    found = next((found for found in gather_everywhere(problem) if found is not None), None)
    if found is not None:
        raise found


def gather_everywhere(value: T) -> list[T]:
    """Every rank's ``value``, by rank (collective; ``[value]`` without a process group)."""
    if not dist.is_initialized():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _damage(path: Path) -> Exception | None:
    if not path.exists():
        return FileNotFoundError(f"No checkpoint at {path}.")
    if not path.is_dir():
        return None  # a single-file checkpoint: read on every rank, which says if it cannot be
    parts = [path / _METADATA_FILENAME, path / ".metadata"]
    if not any(part.exists() for part in parts) and not any(path.glob("*.distcp")):
        return ValueError(
            f"{path} does not point to a valid checkpoint: it is a directory without a sharded checkpoint's files"
            " (meta.pt, .metadata, *.distcp). Pass a sharded checkpoint's directory or a single-file checkpoint."
        )
    missing = [part.name for part in parts if not part.is_file()]
    if missing:
        return FileNotFoundError(
            f"{path} is an incomplete sharded checkpoint: {' and '.join(missing)} missing. Resume from an earlier"
            " checkpoint."
        )
    if not _is_torch_save(parts[0]):
        return ValueError(f"{parts[0]} is damaged (not a file torch.save wrote). Resume from an earlier checkpoint.")
    try:
        index = FileSystemReader(path).read_metadata().storage_data
    except Exception as error:
        return ValueError(f"{parts[1]} cannot be read ({error}). Resume from an earlier checkpoint.")
    needed: dict[str, int] = {}
    for item in index.values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            return FileNotFoundError(f"{shard} is missing from the checkpoint. Resume from an earlier checkpoint.")
        if shard.stat().st_size < size:
            return ValueError(
                f"{shard} is truncated: {shard.stat().st_size} bytes, where the checkpoint's index needs {size}."
                " Resume from an earlier checkpoint."
            )
    return None


@contextmanager
def explain_save_failure(target: Path) -> Generator[None, None, None]:
    """Raise an ``OSError`` that says which ranks could not write the checkpoint ``target`` and why, in place of
    what torch raises: torch.save reports a write the OS refused (ENOSPC on a full disk) as "unexpected pos",
    and torch's distributed checkpoint hands every rank the failures without the exception chain that held the
    OS error. The free space left on the file system says the rest."""
    try:
        yield
    except CheckpointException as error:
        raise OSError(
            _save_failure(target, {rank: failure for rank, (failure, _) in error.failures.items()})
        ) from error
    except RuntimeError as error:  # torch.save of Lightning's meta.pt, on rank 0
        if "unexpected pos" not in str(error):
            raise
        raise OSError(_save_failure(target, {dist.get_rank() if dist.is_initialized() else 0: error})) from error


def _save_failure(target: Path, failures: dict[int, BaseException]) -> str:
    ranks = sorted(failures)
    first = failures[ranks[0]]
    reason = f"{type(first).__name__}: {str(first).strip().splitlines()[0] if str(first).strip() else ''}"
    if "unexpected pos" in reason:
        reason += ", torch.save's report of a write that failed"
    try:
        free = f"; {shutil.disk_usage(target.parent).free / 2**30:.2f} GiB are free on its file system"
    except OSError:
        free = ""
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    return (
        f"Could not save the checkpoint {target}: {who} failed to write ({reason}){free}. {target} was left as it was."
    )
