"""Answers to the questions a step on the meta device asks of its tensors' values.

A probe step runs the model's own code on meta tensors, and that code asks of values: ``if mask.any():``,
``sizes.tolist()``, ``hidden[image_mask]``. Where a meta tensor was computed from CPU tensors alone (token ids, image
grids and sizes, the probe's metadata), :class:`AnswerDataQuestions` keeps its values beside it, computed on the CPU,
and answers from them: a boolean mask of the image placeholders selects as many rows as there are placeholders. Any
other question is answered with zero (``bool`` false, ``item()`` 0, a copy to the CPU all zeros; activations copied
stay on the meta device), and a boolean mask of unknown values takes every element as set (an experts loop then
visits every expert; ``pixel_values[real_images]`` keeps every image, as the probe's images all are).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.fx.experimental import _config as fx_config
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten

VALUES_LIMIT = 1 << 24  # elements: values are kept of small tensors (masks and positions), never of activations
_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
_NO_VALUES = {aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default, aten.empty_like.default}


class AnswerDataQuestions(TorchDispatchMode):
    """Keeps the values of meta tensors computed from CPU tensors alone and answers value questions from them (see
    the module's docstring). CPU tensors an operation combines with meta ones are moved to the meta device, their
    values kept."""

    def __init__(self) -> None:
        super().__init__()
        self.values = WeakIdKeyDictionary()  # meta tensor -> its values, a CPU tensor
        self._assume_nonzero = fx_config.patch(meta_nonzero_assume_all_nonzero=True)

    def __enter__(self) -> AnswerDataQuestions:
        self._assume_nonzero.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._assume_nonzero.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = _tensors(args, kwargs)
        if not any(tensor.device.type == "meta" for tensor in tensors) and _target(kwargs) != "meta":
            return func(*args, **kwargs)  # the CPU's own computation
        if any(tensor.ndim and tensor.device.type != "meta" for tensor in tensors):
            args, kwargs = _mapped(self._cpu_moved, args, kwargs)
        if func is aten._local_scalar_dense.default:
            known = self.values.get(args[0])
            return known.item() if known is not None else _zero_of(args[0].dtype)
        if func is aten._to_copy.default and _is_meta(args[0]) and _target(kwargs) not in (None, "meta"):
            return self._copied_out(args[0], kwargs)
        if func is aten.nonzero.default and args[0] in self.values:
            return self._meta_of(self.values[args[0]].nonzero())
        if func in _INDEXING:
            args = (args[0], self._masks_as_indices(args[1]), *args[2:])
        output = func(*args, **kwargs)
        self._follow(func, args, kwargs, output)
        return output

    def _cpu_moved(self, leaf: Any) -> Any:
        """``leaf`` on the meta device where it is a CPU tensor of one or more dimensions, its values kept."""
        if not isinstance(leaf, torch.Tensor) or not leaf.ndim or leaf.device.type == "meta":
            return leaf
        if isinstance(leaf, DTensor):
            local = leaf.to_local().to("meta")
            return DTensor.from_local(local, leaf.device_mesh, leaf.placements, shape=leaf.shape, stride=leaf.stride())
        return self._meta_of(leaf)

    def _meta_of(self, values: torch.Tensor) -> torch.Tensor:
        meta = values.to("meta")
        if values.numel() <= VALUES_LIMIT:
            self.values[meta] = values
        return meta

    def _copied_out(self, tensor: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """A meta tensor copied to another device (``.tolist()``, ``.cpu()``, ``.to(input_ids.device)``): its values;
        else, for activations (floating point), the copy stays on the meta device (autograd's gradients must too),
        and other tensors are zeros."""
        dtype = kwargs.get("dtype") or tensor.dtype
        known = self.values.get(tensor)
        if known is not None:
            return known.to(dtype=dtype, device=kwargs["device"])
        if dtype.is_floating_point or dtype.is_complex:
            return tensor.to(dtype=dtype)
        return torch.zeros(tensor.shape, dtype=dtype, device=kwargs["device"])

    def _masks_as_indices(self, indices: list) -> list:
        """Boolean masks of known values as the index tensors of their set elements (as torch's own indexing turns
        them); a mask of unknown values stays: the meta kernel takes every element as set."""
        converted = []
        for index in indices:
            known = self.values.get(index) if isinstance(index, torch.Tensor) else None
            if known is not None and index.dtype in (torch.bool, torch.uint8):
                converted.extend(self._meta_of(part) for part in known.bool().nonzero(as_tuple=True))
            else:
                converted.append(index)
        return converted

    def _follow(self, func, args: tuple, kwargs: dict, output: Any) -> None:
        """Compute ``output``'s values on the CPU where every tensor of the operation has values and they are small;
        else forget the values of the tensors it wrote into."""
        if self._computable(func, args, kwargs, output):
            cpu_args, cpu_kwargs = _mapped(self._values_of, args, kwargs)
            if _target(cpu_kwargs) == "meta":
                cpu_kwargs = {**cpu_kwargs, "device": torch.device("cpu")}
            computed = func(*cpu_args, **cpu_kwargs)
            for meta, value in zip(_tensors(output), _tensors(computed), strict=True):
                self.values[meta] = value
            return
        for argument, schema in zip(args, func._schema.arguments, strict=False):
            if schema.alias_info is not None and schema.alias_info.is_write and isinstance(argument, torch.Tensor):
                self.values.pop(argument, None)

    def _computable(self, func, args: tuple, kwargs: dict, output: Any) -> bool:
        """Whether every argument of the operation has values (its meta tensors known; None has none), none is a
        DTensor, the outputs are small and the operation is neither an allocation nor random."""
        if func in _NO_VALUES or torch.Tag.nondeterministic_seeded in func.tags:
            return False
        for leaf in _leaves(args, kwargs):
            if leaf is None or isinstance(leaf, DTensor) or (_is_meta(leaf) and leaf not in self.values):
                return False
        return all(tensor.numel() <= VALUES_LIMIT for tensor in _tensors(output))

    def _values_of(self, leaf: Any) -> Any:
        return self.values[leaf] if _is_meta(leaf) else leaf


def _is_meta(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and not isinstance(leaf, DTensor) and leaf.device.type == "meta"


def _target(kwargs: dict) -> str | None:
    """The device type an operation's ``device`` argument names (None where it names none)."""
    device = kwargs.get("device")
    return torch.device(device).type if device is not None else None


def _leaves(*values: Any) -> list[Any]:
    """The leaves of ``values``: an operator's arguments (and keyword arguments' values) or outputs, which are
    tensors, scalars, None or lists of them (aten's schemas nest no deeper)."""
    found = []
    for value in values:
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list | tuple) else [value]
        for item in items:
            if isinstance(item, list | tuple):
                found.extend(item)
            else:
                found.append(item)
    return found


def _tensors(*values: Any) -> list[torch.Tensor]:
    return [leaf for leaf in _leaves(*values) if isinstance(leaf, torch.Tensor)]


def _mapped(function: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with ``function`` applied to each of their leaves (one level of lists within)."""

    def leaf_or_list(value: Any) -> Any:
        if type(value) in (list, tuple):  # a torch.Size stays whole, as pytree kept it
            return type(value)(function(leaf) for leaf in value)
        return function(value)

    return tuple(leaf_or_list(arg) for arg in args), {name: leaf_or_list(arg) for name, arg in kwargs.items()}


def _zero_of(dtype: torch.dtype) -> bool | int | float:
    if dtype == torch.bool:
        return False
    return 0.0 if dtype.is_floating_point or dtype.is_complex else 0
