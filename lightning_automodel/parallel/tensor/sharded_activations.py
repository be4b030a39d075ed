"""What each module receives once a plan shards the model, read from two probes of it (as it is, and sharded): the
modules that compute on sharded activations with whole parameters, whose gradients would silently be wrong, and the
layouts that do not fit the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from lightning_automodel.parallel.probe.step import Call, TensorArg, Trace
from lightning_automodel.parallel.tensor.styles.parameters import ReplicateOnShardedInput


@dataclass(frozen=True)
class LayoutMismatch:
    """A tensor a module receives in the sharded step that is neither whole, nor one shard of the one-process one."""

    module: str
    argument: int | str
    expected: tuple[int, ...]  # its shape in one process
    found: tuple[int, ...]  # its (global, for a DTensor) shape in the sharded step
    dtensor: bool

    def __str__(self) -> str:
        what = "a DTensor standing for shape" if self.dtensor else "a tensor of shape"
        argument = f"argument {self.argument}" if isinstance(self.argument, int) else f"argument {self.argument!r}"
        return f"{self.module} ({argument}) gets {what} {self.found} where one process gives it {self.expected}"


@dataclass
class ShardedActivations:
    """What the sharded probe found: styles for modules computing on sharded activations (by module name), the
    parameters computing on them in modules that receive only whole tensors, and tensors in layouts that do not fit."""

    styles: dict[str, ReplicateOnShardedInput]
    unfixable: list[str]
    mismatches: list[LayoutMismatch]


def find_sharded_activations(
    model: nn.Module, unsharded: Trace, sharded: Trace, *, tp: int, failed_in: Sequence[str] = ()
) -> ShardedActivations:
    """Compare the probes of ``model`` before and after sharding (``model`` is the sharded one).

    Every tensor a module receives in the sharded step is whole (the one-process shape), this rank's shard (smaller
    along exactly one dimension, by tp), a DTensor of the one-process global shape, or a layout that does not fit (a
    mismatch: a style took the whole sequence for a shard, or the module's code read a global size). A module whose
    whole parameters an operation combines with a shard (see :func:`parameters_meeting_shards`), or that holds plain
    parameters and receives a shard, gets :class:`ReplicateOnShardedInput`, which makes their gradients right; where
    it receives only whole tensors (GPT-OSS's sinks, used on its heads in the attention's own code), no style can, and
    the parameter is unfixable.

    ``failed_in``: the modules running when the sharded probe failed, outermost first; the innermost of them that
    holds plain tensors and was given a DTensor gets a style too.
    """
    layouts_of: dict[str, dict[int | str, Placement | None]] = {}
    mismatches: list[LayoutMismatch] = []
    for name, calls in sharded.calls.items():
        layouts_of[name] = {}
        for call, reference in zip(calls, unsharded.calls.get(name, []), strict=False):
            found, wrong = _layouts(name, call, reference, tp=tp)
            mismatches += wrong
            layouts_of[name].update(found)
    styled = [name for name, layouts in layouts_of.items() if _shard_in(layouts) and _plain_parameters(model, name)]
    given_dtensors = [name for name in failed_in if any(p is None for p in layouts_of.get(name, {}).values())]
    failing = [name for name in given_dtensors if _plain_tensors(model.get_submodule(name))][-1:]
    styles = {name: _style(layouts_of[name]) for name in dict.fromkeys([*styled, *failing])}
    meeting_shards = parameters_meeting_shards(unsharded, sharded)
    unfixable = [name for name in meeting_shards if name.rpartition(".")[0] not in styles]
    return ShardedActivations(styles, unfixable, mismatches)


def parameters_meeting_shards(unsharded: Trace, sharded: Trace) -> list[str]:
    """Plain parameters some operation of the sharded step combines with activations into a result of another shape
    than in one process: they compute on shards, and each rank would get part of their gradient."""
    return [
        name
        for name, shapes in sharded.uses.items()
        if name in unsharded.uses and shapes != unsharded.uses[name][: len(shapes)]
    ]


def _style(layouts: dict[int | str, Placement | None]) -> ReplicateOnShardedInput:
    plain = {key: placement for key, placement in layouts.items() if placement is not None}
    return ReplicateOnShardedInput(input_layouts=plain, use_local_output=len(plain) == len(layouts))


def _layouts(
    name: str, call: Call, reference: Call, *, tp: int
) -> tuple[dict[int | str, Placement | None], list[LayoutMismatch]]:
    """Each argument's layout (None: a DTensor already), and the arguments whose layout does not fit."""
    layouts: dict[int | str, Placement | None] = {}
    wrong = []
    for key, arg in call.inputs.items():
        if key not in reference.inputs:
            continue
        expected = reference.inputs[key].shape
        placement = _placement(arg, expected, tp=tp)
        if placement is _MISMATCH:
            found = arg.global_shape if arg.global_shape is not None else arg.shape
            wrong.append(LayoutMismatch(name, key, expected, found, dtensor=arg.global_shape is not None))
        else:
            layouts[key] = placement
    return layouts, wrong


_MISMATCH = object()


def _placement(arg: TensorArg, expected: tuple[int, ...], *, tp: int) -> Placement | None | object:
    if arg.global_shape is not None:
        return None if arg.global_shape == expected else _MISMATCH
    if arg.shape == expected:
        return Replicate()
    differ = [dim for dim, (a, b) in enumerate(zip(arg.shape, expected, strict=False)) if a != b]
    if len(arg.shape) == len(expected) and len(differ) == 1 and arg.shape[differ[0]] * tp == expected[differ[0]]:
        return Shard(differ[0])
    return _MISMATCH


def _shard_in(layouts: dict[int | str, Placement | None]) -> bool:
    return any(isinstance(p, Shard) for p in layouts.values())


def _plain_parameters(model: nn.Module, name: str) -> bool:
    return any(not isinstance(p, DTensor) for p in model.get_submodule(name).parameters(recurse=False))


def _plain_tensors(module: nn.Module) -> bool:
    return any(not isinstance(t, DTensor) for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)])
