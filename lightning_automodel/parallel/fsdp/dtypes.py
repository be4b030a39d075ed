"""Which dtype each parameter computes in, and the largest submodules that compute in a single one.

FSDP2 gathers a unit's parameters in one dtype, so a model whose parameters compute in several dtypes (a bf16
model with an fp32 router, fp32 master weights with a layer pinned to fp32) must be cut into dtype-uniform
units. These helpers find the cuts; :func:`lightning_automodel.parallel.fsdp.sharding.fully_shard_by_dtype` makes them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

UniformSubtreeItem = tuple[nn.Module, torch.dtype] | tuple[str, nn.Module, torch.dtype]


def iter_maximal_uniform_dtype_subtrees(
    module: nn.Module,
    *,
    include_buffers: bool = True,
    tensor_pred: Callable[[torch.Tensor], bool] | None = None,
    dtype_of: Callable[[torch.Tensor], torch.dtype] | None = None,
    return_paths: bool = False,
) -> Iterator[UniformSubtreeItem]:
    """Yield the largest submodules (``module`` itself included) whose whole subtree holds tensors of one dtype.

    No yielded module lies inside another. Subtrees holding no tensor that passes ``tensor_pred`` are skipped;
    a module shared under two names is yielded once.

    Args:
        include_buffers: let buffers count, not only parameters.
        tensor_pred: which tensors count (default: all), e.g. ``torch.is_floating_point``.
        dtype_of: the dtype a tensor counts as (default: its storage dtype), e.g. its compute dtype.
        return_paths: yield ``(qualified_name, module, dtype)`` instead of ``(module, dtype)``; the name is
            relative to ``module`` ("" for ``module`` itself).
    """
    dtype_of = dtype_of or (lambda tensor: tensor.dtype)
    tensor_pred = tensor_pred or (lambda tensor: True)
    subtree_dtypes: dict[int, frozenset[torch.dtype]] = {}

    def dtypes(node: nn.Module) -> frozenset[torch.dtype]:
        if id(node) not in subtree_dtypes:
            own: Iterable[torch.Tensor] = node.parameters(recurse=False)
            if include_buffers:
                own = [*own, *node.buffers(recurse=False)]
            found = {dtype_of(tensor) for tensor in own if tensor_pred(tensor)}
            for child in node.children():
                found |= dtypes(child)
            subtree_dtypes[id(node)] = frozenset(found)
        return subtree_dtypes[id(node)]

    yielded: set[int] = set()

    def visit(path: str, node: nn.Module) -> Iterator[UniformSubtreeItem]:
        found = dtypes(node)
        if len(found) == 1:
            if id(node) not in yielded:
                yielded.add(id(node))
                (dtype,) = found
                yield (path, node, dtype) if return_paths else (node, dtype)
            return
        for name, child in node.named_children():
            yield from visit(f"{path}.{name}" if path else name, child)

    yield from visit("", module)


def compute_dtype_resolver(
    module: nn.Module, *, param_dtype: torch.dtype | None, fp32_module_names: Iterable[str] = ()
) -> Callable[[torch.Tensor], torch.dtype]:
    """The dtype each floating tensor of ``module`` should compute in, by precedence:

    1. fp32 (or its storage dtype if wider) if its name matches one of ``fp32_module_names`` (a model's
       ``_keep_in_fp32_modules_strict``; see :func:`pinned_to_fp32`);
    2. ``param_dtype`` (the mixed-precision compute dtype) if the module's floating parameters are all stored in
       one dtype: uniform fp32 storage is master weights, meant to compute in the policy's dtype;
    3. its own storage dtype otherwise: a parameter stored apart from its peers (an fp32 router in a bf16 model)
       is intrinsically that dtype, and casting it would undo what the model's author asked for.

    Non-floating tensors keep their dtype.
    """
    pinned = {id(tensor) for _, _, tensor in pinned_to_fp32(module, fp32_module_names)}
    storage = {p.dtype for p in module.parameters() if p.is_floating_point()}
    fallback = param_dtype if len(storage) == 1 else None

    def dtype_of(tensor: torch.Tensor) -> torch.dtype:
        if not tensor.is_floating_point():
            return tensor.dtype
        if id(tensor) in pinned:
            return torch.promote_types(tensor.dtype, torch.float32)
        return fallback or tensor.dtype

    return dtype_of


def pinned_to_fp32(module: nn.Module, fp32_module_names: Iterable[str]) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """``(owner, attribute, tensor)`` of every parameter and buffer whose qualified name matches one of
    ``fp32_module_names`` (dotted names such as ``"gate.weight"`` or ``"moe_statics"``, matched as whole name
    components, so ``"gate"`` does not match ``gate_proj``)."""
    patterns = [name.split(".") for name in fp32_module_names]
    found = []
    for owner_name, owner in module.named_modules(remove_duplicate=False):
        own = [*owner.named_parameters(recurse=False), *owner.named_buffers(recurse=False)]
        for attribute, tensor in own:
            qualified = f"{owner_name}.{attribute}" if owner_name else attribute
            if tensor is not None and _matches_any(qualified.split("."), patterns):
                found.append((owner, attribute, tensor))
    return found


@contextmanager
def keep_pinned_fp32(module: nn.Module, fp32_module_names: Iterable[str]) -> Iterator[None]:
    """Undo, on leaving the block, any cast of ``module``'s fp32 tensors pinned by ``fp32_module_names``.

    ``module.to(torch.bfloat16)`` casts everything, which is not what a model that pins parameters to fp32 asks
    for (Hugging Face's ``from_pretrained(dtype=torch.bfloat16)`` leaves them fp32). The original fp32 values are
    put back, not an upcast of the rounded ones.
    """
    kept = [
        (owner, attribute, tensor.detach())
        for owner, attribute, tensor in pinned_to_fp32(module, fp32_module_names)
        if tensor.dtype == torch.float32
    ]
    try:
        yield
    finally:
        for owner, attribute, original in kept:
            if attribute in owner._parameters:
                owner._parameters[attribute].data = original
            else:
                owner._buffers[attribute] = original


def _matches_any(components: list[str], patterns: list[list[str]]) -> bool:
    return any(
        components[start : start + len(pattern)] == pattern
        for pattern in patterns
        for start in range(len(components) - len(pattern) + 1)
    )
