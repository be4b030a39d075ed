"""Probe steps remembered by the structure of the model they ran, for the planner.

The planner parallelizes copies of one model many times (a layout's state, its step and its optimizer's, each at a
few layer counts; every candidate of a search), and each ``parallelize`` probes the model before any collective: the
same step on the same structure, most of a small candidate's time. Within :func:`probes_remembered` a probe of a
model whose structure was probed before is not run again. The structure is everything a meta-device step of the
model can read: its class and config, each module's class and mode, each parameter's and buffer's shape, dtype and
whether it trains. Training itself never remembers: it probes its one model once.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

from torch import nn

_Found = TypeVar("_Found")
_STORE: ContextVar[dict[Hashable, Any] | None] = ContextVar("probes_remembered", default=None)


@contextmanager
def probes_remembered(store: dict[Hashable, Any] | None = None) -> Iterator[None]:
    """Within it (a context or a decorator), probes are remembered in ``store``: the caller's, which carries them
    from one context to the next; None: those remembered already, where a context encloses this one, else a new
    store."""
    if store is None:
        store = _STORE.get()
    token = _STORE.set(store if store is not None else {})
    try:
        yield
    finally:
        _STORE.reset(token)


def remembered(model: nn.Module, *, how: Hashable, probe: Callable[[], _Found]) -> _Found:
    """``probe()``, a probe of ``model`` run ``how`` (what else it depends on), or what it found before on a model
    of the same structure while probes are remembered. What it returns is shared: read it, never change it."""
    store = _STORE.get()
    if store is None:
        return probe()
    key = (structure(model), how)
    if key not in store:
        store[key] = probe()
    return store[key]


def structure(model: nn.Module) -> Hashable:
    """What a meta-device step of ``model`` can read of it, but its weights' values."""
    config = getattr(model, "config", None)
    settings = None
    if config is not None:
        private = ("_attn_implementation", "_experts_implementation")
        settings = (config.to_json_string(), *(str(getattr(config, name, None)) for name in private))
    modules = tuple((name, type(module), module.training) for name, module in model.named_modules())
    parameters = tuple(
        (name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in model.named_parameters(remove_duplicate=False)
    )
    buffers = tuple((name, tuple(b.shape), b.dtype) for name, b in model.named_buffers(remove_duplicate=False))
    return type(model), settings, modules, parameters, buffers
