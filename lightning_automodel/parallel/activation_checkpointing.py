"""Activation checkpointing: recompute activations in backward instead of keeping them, in three granularities.

- ``"full"``: each decoder layer keeps only its input; everything inside is recomputed.
- ``"selective"``: inside each layer, the outputs of attention and of every other matmul are kept, the cheap
  ops between them (norms, activations, rotary, residual adds) are recomputed.
- ``"submodule"``: attention and MLP are checkpointed separately; the norms and residuals between them keep
  their activations.

Uses torch's composable ``checkpoint``, which works through module hooks: parameter names stay those of the
Hugging Face model, so state dicts, checkpoints and exports need no renaming. Blocks compiled by ``torch.compile``
(see :mod:`~lightning_automodel.parallel.compile`) take ``"selective"`` and ``"submodule"`` as calls of
``torch.utils.checkpoint`` inside their forward instead, which dynamo traces into the compiled graph (torchtitan's
way): hooks stay outside a compiled forward, whose ops a policy never sees dispatched.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from types import MethodType
from typing import Literal

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from lightning_automodel.parallel.model_calls import build_no_cache

ACMode = Literal["off", "selective", "submodule", "full"]
# Every mode, from the least recomputation to the most (the order plan reports list them in).
AC_MODES: tuple[ACMode, ...] = ("off", "selective", "submodule", "full")

# Names Hugging Face decoder layers give their attention and MLP blocks.
_SUBMODULE_NAMES = ("self_attn", "attention", "attn", "mlp", "feed_forward")

_ATTENTION_OPS = {
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}
_MATMUL_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def ac_mode(setting: bool | ACMode) -> ACMode:
    """The mode an ``activation_checkpointing`` setting names: True is "full", False "off"; a name of
    :data:`AC_MODES` is itself. Everything past the arguments holds the mode."""
    if isinstance(setting, bool):
        return "full" if setting else "off"
    if setting not in AC_MODES:
        raise ValueError(
            f'activation_checkpointing={setting!r}: use False, True/"full", "selective" or "submodule" ("off" is'
            " False)."
        )
    return setting


def apply_activation_checkpointing(
    model: nn.Module, layers: Sequence[nn.Module], mode: bool | ACMode = "full", *, compiled: bool = False
) -> None:
    """Checkpoint each decoder layer in ``layers`` with ``mode`` (a setting :func:`ac_mode` reads; "off" leaves them
    as they are); ``compiled``: the layers' forwards are to be compiled next, the checkpoints of "selective" and
    "submodule" go inside them."""
    mode = ac_mode(mode)
    if mode == "off":
        return
    if not layers:
        raise ValueError(
            f"activation_checkpointing found no decoder layers in {type(model).__name__}: it needs a ModuleList of"
            " transformer blocks (model.layers in Hugging Face models)."
        )
    build_no_cache(model)  # a KV cache built in the first forward would be built again on recompute
    for layer in layers:
        if mode == "full":
            checkpoint(layer)
        elif mode == "selective" and compiled:
            _checkpoint_in_forward(layer, context_fn=_traced_selective_contexts)
        elif mode == "selective":
            checkpoint(layer, context_fn=_selective_contexts)
        else:
            for block in _attention_and_mlp(layer):
                _checkpoint_in_forward(block) if compiled else checkpoint(block)


def _checkpoint_in_forward(module: nn.Module, context_fn: Callable | None = None) -> None:
    """Make ``module``'s forward run its current one under ``torch.utils.checkpoint`` (non-reentrant, which dynamo
    traces). The same function for every module, the module's own as an attribute: blocks compiled alike share one
    graph."""
    module.checkpointed_forward = module.forward.__func__
    module.checkpoint_context = context_fn
    module.forward = MethodType(_checkpointed_forward, module)


def _checkpointed_forward(self: nn.Module, *args: object, **kwargs: object) -> object:
    context = {} if self.checkpoint_context is None else {"context_fn": self.checkpoint_context}
    return torch_checkpoint(self.checkpointed_forward, self, *args, use_reentrant=False, **context, **kwargs)


def _traced_selective_contexts() -> tuple:
    """One context pair per layer call: the forward and its recompute must count matmuls the same way. As they are
    for a compiled forward, where dynamo traces the checkpoint and AOTAutograd applies the policy to the graph's ops
    (no profiler marks there: FSDP2's hooks stay outside the compiled block)."""
    counts: dict[str, int] = defaultdict(int)
    return create_selective_checkpoint_contexts(partial(_keep_attention_and_every_other_matmul, counts))


def _attention_and_mlp(layer: nn.Module) -> list[nn.Module]:
    blocks = [child for name, child in layer.named_children() if name in _SUBMODULE_NAMES]
    if not blocks:
        raise ValueError(
            f'activation_checkpointing="submodule" found no attention or MLP block in {type(layer).__name__} (looked'
            f' for children named {", ".join(_SUBMODULE_NAMES)}); use "full" or "selective".'
        )
    return blocks


def _selective_contexts() -> tuple:
    """:func:`_traced_selective_contexts` with profiler marks passing both by (see :class:`_ProfilerMarksPass`)."""
    forward, recompute = _traced_selective_contexts()
    return _marks_passing(forward), _marks_passing(recompute)


@contextmanager
def _marks_passing(context: AbstractContextManager) -> Iterator[None]:
    with context, _ProfilerMarksPass():
        yield


class _ProfilerMarksPass(TorchDispatchMode):
    """Runs profiler marks (``record_function``'s ops) past every dispatch mode beneath it: the selective
    checkpoint's, and any other (a memory tracker, a FLOP counter), to which a mark is nothing.

    Under a mixed-precision policy, torch 2.13's FSDP2 casts a layer's inputs inside a ``record_function`` before
    the checkpoint's hook in the forward, and again inside the recomputation: the recomputation meets a mark the
    forward never stored, and the checkpoint raises ("profiler._record_function_enter_new.default encountered during
    backward but not found in storage"). Marks compute nothing; neither pass stores them."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        if func.namespace == "profiler":
            with _disable_current_modes():
                return func(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _keep_attention_and_every_other_matmul(
    counts: dict[str, int], ctx: object, op: Callable, *args: object, **kwargs: object
) -> CheckpointPolicy:
    if op in _ATTENTION_OPS:
        return CheckpointPolicy.MUST_SAVE
    if op in _MATMUL_OPS:
        phase = "recompute" if ctx.is_recompute else "forward"
        counts[phase] += 1
        if counts[phase] % 2 == 1:  # 1st, 3rd, ... matmul: keep; the others are recomputed from them
            return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE
