"""Whether a checkpoint holds what this run loads: the same weights and optimizer state, of the same shapes.

A checkpoint of another configuration (a layer more or fewer, a parameter trained in one run and frozen in the
other) would otherwise load what both hold, leave the rest as built and drop what this run has no place for,
without a word. Each rank holds its own parameters (under pp, its stages'): the ranks' lists are put together
before the comparison, so that what another stage holds is not taken for something this run lacks.

Keys are the checkpoint's: ``state_dict.<weight>`` and ``optimizer_<i>.state.<parameter>.<state>``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_automodel.hf.packed_weights import packed_block_keys

WEIGHTS = "state_dict."
Size = tuple[int, ...] | int  # a shape; or the number of values of a packed weight stored block by block


def optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


@dataclass(frozen=True)
class Held:
    """What one rank loads into: its tensors' (global) sizes by key, each optimizer's param groups (the names of
    their parameters on this rank, in order), and the weights it holds but leaves as built (frozen ones, when
    checkpoints hold the trainable parameters only)."""

    sizes: dict[str, Size]
    groups: list[list[list[str]]]
    kept: frozenset[str] = frozenset()

    @classmethod
    def of(
        cls, model_state: dict[str, Any], optimizer_states: list[dict[str, Any]], *, kept: frozenset[str] = frozenset()
    ) -> Held:
        sizes: dict[str, Size] = {WEIGHTS + name: tuple(tensor.shape) for name, tensor in model_state.items()}
        for index, state in enumerate(optimizer_states):
            sizes.update(optimizer_sizes(index, state["state"]))
        groups = [[list(group["params"]) for group in state["param_groups"]] for state in optimizer_states]
        return cls(sizes, groups, kept)


@dataclass(frozen=True)
class Stored:
    """What a checkpoint holds: its tensors' sizes by key, each optimizer's number of param groups, by optimizer why
    its state cannot be placed on this run's parameters (a file that keys it by position), and each optimizer's
    state placed on them, by parameter name, where the reader holds it in memory (a single file; a sharded
    checkpoint's is read from its shards by name)."""

    sizes: dict[str, Size]
    group_counts: list[int]
    unplaced: dict[int, str] = field(default_factory=dict)
    states: list[dict[str, dict[str, Any]]] = field(default_factory=list)

    def unloadable(self, index: int) -> str | None:
        """Why optimizer ``index``'s state cannot be loaded into this run, or None: the checkpoint holds none of it
        (every optimizer has a param group), or cannot place it."""
        if index >= len(self.group_counts) or not self.group_counts[index]:
            return "the checkpoint holds no state of it (saved with save_weights_only, or by fewer optimizers?)"
        return self.unplaced.get(index)


def optimizer_sizes(index: int, state: dict[str, dict[str, Any]]) -> dict[str, Size]:
    """The sizes of an optimizer's state tensors (``state``: by parameter name, then by state name)."""
    prefix = f"{optimizer_key(index)}.state."
    return {
        f"{prefix}{name}.{key}": tuple(value.shape)
        for name, values in state.items()
        for key, value in values.items()
        if isinstance(value, torch.Tensor)
    }


def folded_blocks(sizes: dict[str, tuple[int, ...]]) -> dict[str, Size]:
    """``sizes`` with each packed weight's blocks (``name.block0``, ...) as one entry: its number of values."""
    blocks_of = packed_block_keys(sizes)
    in_blocks = {key for blocks in blocks_of.values() for key in blocks}  # not a module named "blocks"
    folded: dict[str, Size] = {key: size for key, size in sizes.items() if key not in in_blocks}
    for name, blocks in blocks_of.items():
        folded[name] = sum(torch.Size(sizes[block]).numel() for block in blocks)
    return folded


def misfit(path: Path, stored: Stored, held_by_rank: list[Held], *, strict: bool) -> Exception | None:
    """Why ``path`` cannot be loaded into this run (``held_by_rank``: every rank's), or None. Tensors of other
    shapes are always refused; with ``strict`` (the LightningModule's ``strict_loading``), also what one side holds
    and the other lacks. Optimizer state the checkpoint lacks for a parameter whose weights it holds is not
    missing: the parameter never got a gradient (a vision tower in text-only training), and its state starts
    fresh as it would have."""
    held: dict[str, Size] = {}
    for rank in held_by_rank:
        held.update(rank.sizes)
    wrong = [_difference(key, stored.sizes[key], size) for key, size in held.items() if key in stored.sizes]
    wrong = [difference for difference in wrong if difference]
    if wrong:
        return ValueError(
            f"{path} does not fit this model: {_listed(wrong, separator='; ')}. It is a checkpoint of another model"
            " or configuration."
        )
    if not strict:
        return None
    kept = frozenset().union(*(rank.kept for rank in held_by_rank))
    found = _unmatched(stored, held, [rank.groups for rank in held_by_rank], kept=kept)
    if not found:
        return None
    return ValueError(
        f"{path} does not hold what this run loads, and the LightningModule's strict_loading is on (to load what both"
        " hold and keep the rest as this run built it, set `self.strict_loading = False` in its __init__):\n  "
        + "\n  ".join(found)
        + "\nIs it a checkpoint of another configuration (another number of layers, other parameters trained)?"
    )


def _unmatched(
    stored: Stored, held: dict[str, Size], groups_by_rank: list[list[list[list[str]]]], *, kept: frozenset[str]
) -> list[str]:
    """One line for each kind of mismatch: weights, then each optimizer's state and param groups."""
    found = []
    weights = {key[len(WEIGHTS) :] for key in held if key.startswith(WEIGHTS)}
    saved = {key[len(WEIGHTS) :] for key in stored.sizes if key.startswith(WEIGHTS)}
    if weights - saved:
        found.append(f"weights of this model that the checkpoint lacks: {_listed(sorted(weights - saved))}")
    if saved - weights - kept:
        found.append(f"weights in the checkpoint that this model lacks: {_listed(sorted(saved - weights - kept))}")
    optimizers = max((len(groups) for groups in groups_by_rank), default=0)
    if optimizers == 0:  # not fitting: the checkpoint's optimizer state is not loaded
        return found
    for index in range(max(optimizers, len(stored.group_counts))):
        key = optimizer_key(index)
        if index >= optimizers:
            found.append(f"{key}: in the checkpoint, and this run has {optimizers} optimizer(s)")
            continue
        trained = {name for groups in groups_by_rank for group in groups[index] for name in group}
        unloadable = stored.unloadable(index)
        if unloadable is not None:
            found.append(f"{key}: {unloadable}")
            continue
        counts = {len(groups[index]) for groups in groups_by_rank}
        if counts != {stored.group_counts[index]}:
            found.append(f"{key}: {stored.group_counts[index]} param group(s) in the checkpoint, {max(counts)} here")
        with_state = _parameters_with_state(stored.sizes, key)
        if trained - with_state - saved - kept:  # kept: frozen, in a group but never given a gradient
            lacking = sorted(trained - with_state - saved - kept)
            found.append(f"{key}: the checkpoint lacks the state of parameters this run trains: {_listed(lacking)}")
        if with_state - trained:
            extra = sorted(with_state - trained)
            found.append(f"{key}: state in the checkpoint of parameters this run does not train: {_listed(extra)}")
    return found


def _parameters_with_state(sizes: dict[str, Size], key: str) -> set[str]:
    prefix = f"{key}.state."
    return {name[len(prefix) :].rpartition(".")[0] for name in sizes if name.startswith(prefix)}


def _difference(key: str, there: Size, here: Size) -> str | None:
    name = key[len(WEIGHTS) :] if key.startswith(WEIGHTS) else key
    if isinstance(there, int):
        values = torch.Size(here).numel() if isinstance(here, tuple) else here
        return None if there == values else f"{name} holds {there} values there, {values} here"
    return None if tuple(there) == tuple(here) else f"{name} is {tuple(there)} there, {tuple(here)} here"


def _listed(names: list[str], *, shown: int = 3, separator: str = ", ") -> str:
    """The first ``shown`` of ``names``, and how many more there are."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return separator.join(names[:shown]) + more
