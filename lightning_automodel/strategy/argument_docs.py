"""The strategy's arguments described once: each by the docstring of the options field it sets, whose first sentence
becomes its line in the constructor's docstring. LightningCLI's ``--help`` shows those lines (jsonargparse reads the
constructor's docstring), so the help and the options' documentation cannot drift apart.

An argument ``pp_x`` sets ``PipelineOptions.x``; any other the field of its name on the options below, in their
order. The few arguments that set no field of their own are described here.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from collections.abc import Callable
from functools import cache
from typing import TypeVar

from lightning_automodel.parallel.fsdp.options import FSDPOptions
from lightning_automodel.parallel.mesh import ParallelDims
from lightning_automodel.parallel.options import ParallelOptions
from lightning_automodel.parallel.pipeline import PipelineOptions
from lightning_automodel.strategy.options import StrategyOptions

_OPTIONS = (StrategyOptions, ParallelDims, ParallelOptions, FSDPOptions)

DESCRIBED_HERE = {
    "layout": 'None (default): the sizes as given, those unset 1; "auto": the strategy chooses the sizes left unset,'
    " the activation checkpointing and pp's micro-batches at setup, the fastest layout whose step fits the GPU.",
    "data_parallel_size": "Lightning's ModelParallelStrategy name for dp_shard, so that its configurations run"
    " unchanged (both given with different values are refused).",
    "tensor_parallel_size": 'Lightning\'s ModelParallelStrategy name for tp; "auto" is the devices of one node, as'
    " there.",
    "process_group_backend": "Lightning's: the torch.distributed backend (default: nccl on GPUs, gloo on CPUs).",
    "timeout": "Lightning's: how long a collective may wait (default 30 minutes); it also bounds every sub-group of"
    " the mesh, and a rank silent for half of it (60 s at most) is taken for gone.",
}
"""The arguments that set no options field of their own."""

Init = TypeVar("Init", bound=Callable[..., None])


def with_argument_docs(init: Init) -> Init:
    """``init`` with its docstring generated: each argument's description under ``Args:`` (Google style, which
    jsonargparse reads). Where the package's sources are not shipped (a pyc-only install), the fields' docstrings
    cannot be read: the summary alone, so that the package still imports."""
    summary = "The strategy's options, built from its arguments and checked before any process group exists."
    names = list(inspect.signature(init).parameters)[1:]  # self first
    try:
        described = [f"    {name}: {argument_description(name)}" for name in names]
    except (OSError, TypeError):  # inspect.getsource without a source file
        described = []
    init.__doc__ = "\n".join([summary, "", "Args:", *described] if described else [summary])
    return init


def argument_description(name: str) -> str:
    """The one-line description of the strategy's argument ``name``: the first sentence of the field it sets."""
    if name in DESCRIBED_HERE:
        return DESCRIBED_HERE[name]
    owners = [PipelineOptions] if name.startswith("pp_") else list(_OPTIONS)
    field = name.removeprefix("pp_")
    for owner in owners:
        if (doc := field_docs(owner).get(field)) is not None:
            return _first_sentence(doc)
    raise LookupError(
        f"AutoModelParallelStrategy's argument {name} is described nowhere: give the field it sets a docstring, or"
        " describe it in lightning_automodel/strategy/argument_docs.py."
    )


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstrings written under the fields of the dataclass ``cls`` (PEP 257's attribute docstrings)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {
        field.target.id: inspect.cleandoc(doc.value.value)
        for field, doc in zip(body, body[1:], strict=False)
        if isinstance(field, ast.AnnAssign)
        and isinstance(field.target, ast.Name)
        and isinstance(doc, ast.Expr)
        and isinstance(doc.value, ast.Constant)
        and isinstance(doc.value.value, str)
    }


def _first_sentence(doc: str) -> str:
    """The text up to the first full stop that ends a sentence, on one line, without reST markup."""
    plain = re.sub(r":\w+:`~?(?:[\w.]+\.)?(\w+)`", r"\1", doc).replace("``", "")
    sentence = re.match(r"(.*?(?<!e\.g)(?<!i\.e)\.)(?:\s|$)", plain, re.DOTALL)
    return " ".join((sentence[1] if sentence else plain).split())
