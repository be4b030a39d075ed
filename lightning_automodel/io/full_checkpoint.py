"""Lightning's single-file checkpoints (its full-state format: every weight whole, each optimizer's state as
``Optimizer.state_dict()`` gives it) read into the sharded model. Each rank maps the file into memory and copies its
own shard of each tensor out of it: it reads what it copies, and waits for no other rank.

A file written on one device or under DDP keys an optimizer's state by position: the parameters of its param
groups, numbered in order. They are this run's parameters, group by group, in the order the same
``configure_optimizers`` lists them. Under pp a rank holds a share of each group; the whole group is the ranks'
shares put together in the model's order (the order of the file's weights), which holds where the shares keep it.
A file this strategy wrote (``save_distributed_checkpoint=False``) keys the state by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_automodel.hf.initialization import copy_shard
from lightning_automodel.io.checkpoint_contents import WEIGHTS, Held, Stored, optimizer_sizes

STATES = "optimizer_states"  # Lightning's list of the optimizers' state dicts


class FullCheckpoint:
    """The single-file checkpoint at ``path``, mapped into memory."""

    def __init__(self, path: Path, *, weights_only: bool | None) -> None:
        self.path = path
        self.checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
        if not isinstance(self.checkpoint, dict) or not isinstance(self.checkpoint.get("state_dict"), dict):
            raise ValueError(
                f"{path} is not a Lightning checkpoint (it holds no state_dict): pass a file that"
                " trainer.save_checkpoint or ModelCheckpoint wrote."
            )
        self.weights: dict[str, Any] = self.checkpoint["state_dict"]

    def contents(self, held_by_rank: list[Held]) -> Stored:
        """What the file holds, its optimizer state placed on this run's parameters (``held_by_rank``)."""
        sizes = {WEIGHTS + name: tuple(value.shape) for name, value in self.weights.items() if _is_tensor(value)}
        order = {name: position for position, name in enumerate(self.weights)}
        saved = self.checkpoint.get(STATES, [])
        unplaced, states = {}, []
        for index, optimizer in enumerate(saved):
            shares = [rank.groups[index] for rank in held_by_rank if index < len(rank.groups)]
            placed = _by_name(optimizer, shares, order) if shares else {}
            if isinstance(placed, str):
                unplaced[index] = f"{placed}. {_weights_alone(self.path)}"
                placed = {}
            states.append(placed)
            sizes.update(optimizer_sizes(index, placed))
        return Stored(sizes, [len(optimizer["param_groups"]) for optimizer in saved], unplaced, states)

    def load_weights(self, model_state: dict[str, Any], *, strict: bool) -> None:
        """Copy this rank's shard of each weight the file holds into ``model_state`` (others, when not ``strict``,
        stay as built)."""
        for name, target in model_state.items():
            if name in self.weights:
                copy_shard(target, self.weights[name])

    def load_optimizer(self, index: int, optimizer_state: dict[str, Any], *, stored: Stored) -> list[dict[str, Any]]:
        """Fill ``optimizer_state`` (this run's, by parameter name) in place from the state ``stored`` (what
        :meth:`contents` found) placed on it; returns each param group's saved settings, by position."""
        for name, values in optimizer_state["state"].items():
            for key, value in stored.states[index].get(name, {}).items():
                if _is_tensor(value) and _is_tensor(values.get(key)):
                    copy_shard(values[key], value)
                else:
                    values[key] = value
        groups = self.checkpoint[STATES][index]["param_groups"]
        return [{key: value for key, value in group.items() if key != "params"} for group in groups]

    def metadata(self) -> dict[str, Any]:
        """The checkpoint but the weights (loops, callbacks, ...), as Lightning's loader returns it."""
        return {key: value for key, value in self.checkpoint.items() if key != "state_dict"}


def _by_name(
    optimizer: dict[str, Any], shares: list[list[list[str]]], order: dict[str, int]
) -> dict[str, dict[str, Any]] | str:
    """``optimizer``'s state (a state dict) by parameter name, or why it cannot be placed. ``shares``: each rank's
    param groups (their parameters' names)."""
    state, numbers = optimizer["state"], [group["params"] for group in optimizer["param_groups"]]
    if all(isinstance(number, str) for group in numbers for number in group):
        return dict(state)
    groups = _whole_groups(shares, order)
    if isinstance(groups, str):
        return groups
    if len(groups) != len(numbers):
        return f"the file keys its state by position over {len(numbers)} param group(s), and this run has {len(groups)}"
    for position, (names, group) in enumerate(zip(groups, numbers, strict=True)):
        if len(names) != len(group):
            return (
                f"the file keys its state by position, and its param group {position} holds {len(group)} parameters"
                f" where this run's holds {len(names)}"
            )
    pairs = (pair for names, group in zip(groups, numbers, strict=True) for pair in zip(names, group, strict=True))
    return {name: state[number] for name, number in pairs if number in state}


def _whole_groups(shares: list[list[list[str]]], order: dict[str, int]) -> list[list[str]] | str:
    """The whole run's param groups from each rank's share of them, or why they cannot be told."""
    if len({len(groups) for groups in shares}) != 1:
        return "this run's ranks hold different numbers of param groups"
    whole = []
    for position, group_shares in enumerate(zip(*shares, strict=True)):
        distinct = {tuple(share) for share in group_shares}
        if len(distinct) == 1:  # every rank holds the whole group (no pp)
            whole.append(list(group_shares[0]))
            continue
        names = {name for share in distinct for name in share}
        in_order = all(list(share) == sorted(share, key=lambda name: order.get(name, -1)) for share in distinct)
        if not in_order or not names <= order.keys():
            return (
                f"the file keys its state by position, and this run's pipeline stages hold param group {position}'s"
                " parameters in an order other than the model's, or parameters the file lacks"
            )
        whole.append(sorted(names, key=order.__getitem__))
    return whole


def _weights_alone(path: Path) -> str:
    return (
        "To start a new run from its weights alone, load them into the LightningModule before fit"
        f" (module.load_state_dict(torch.load({str(path)!r}, weights_only=False)['state_dict'])) and fit without"
        " ckpt_path; with strict_loading = False, the run resumes with its weights and a fresh optimizer state"
    )


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)
