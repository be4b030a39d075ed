"""The shape probe: one training step of a model on the meta device, recording what every module receives.

On meta tensors kernels only propagate shapes, and so do collectives: the probe computes nothing and communicates
nothing, so every rank can run it before any collective, whatever it finds. Run on a copy of the model before and
after tensor parallel, it shows which modules a step calls and with what (a vision-language model's step carries
images, so that its vision tower runs too: see :mod:`lightning_automodel.hf.vision.image_inputs`), where a plan's
layouts do not fit the model (a module that reads a global size, a style that takes the whole sequence for a shard), and
which modules compute on activations tensor parallel shards (see :mod:`.tensor.sharded_activations`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from lightning_automodel.hf.vision.image_inputs import image_inputs, image_token_count, measured_token_count
from lightning_automodel.parallel.probe.meta_values import AnswerDataQuestions

# Rows and tokens of the probe's batch: small, odd and unlike any model size, so that a dimension a plan splits
# cannot be mistaken for another one of the same size. The sequence is a multiple of tp (sequence parallel splits it).
PROBE_ROWS = 3
PROBE_TOKENS_PER_RANK = 5


@dataclass(frozen=True)
class TensorArg:
    """A tensor a module received: the shape its code sees and, for a DTensor, the global shape it stands for."""

    shape: tuple[int, ...]
    global_shape: tuple[int, ...] | None = None


@dataclass
class Call:
    """One call of a module: its tensor arguments by position or keyword, and whether autograd was recording.

    ``sources``: for each tensor argument that a module's call returned as it is, the innermost such module (a norm
    whose output a projection reads); the others are absent.
    """

    inputs: dict[int | str, TensorArg]
    grad_enabled: bool
    sources: dict[int | str, str] = field(default_factory=dict)


@dataclass
class Trace:
    """Every module call of a probe, by module name, in order; the model's own forward recorded with autograd on.

    ``uses``: for every plain parameter, in order, the shape each operation of the forward produced from it and the
    activations (the data a step computes from its tokens): where it meets them, and how much of them.
    """

    tokens: int  # the sequence length of the probe's batch
    images: bool = False  # whether its rows carried images (see forward_step)
    images_failure: str = ""  # how a step with images failed, where a text-only step stands in for it
    calls: dict[str, list[Call]] = field(default_factory=dict)  # in the forward
    uses: dict[str, list[tuple[int, ...]]] = field(default_factory=dict)
    called_in_backward: set[str] = field(default_factory=set)  # modules run again in backward (checkpointing)
    # Parameters of its own a module returns, for the code around it to compute with (an output bias added later).
    returned_parameters: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def called(self, name: str) -> bool:
        return name in self.calls


class ProbeError(Exception):
    """The probe step failed: ``running`` are the modules running when it did, outermost first (none in backward),
    ``module`` the innermost of them ("" for the backward)."""

    def __init__(self, running: list[str], error: BaseException, trace: Trace) -> None:
        self.running = running
        self.module = running[-1] if running else ""
        self.error = error
        self.trace = trace
        self.detail = f"{type(error).__name__}: {_first_line(error)}"
        super().__init__(f"{self.module or 'backward'}: {self.detail}")


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every parameter and buffer on the meta device; no weight is copied.

    Ties survive (a shared tensor maps to one meta tensor), and so does which parameters train. Mixture-of-experts
    layers compute by batched matmul: the shapes of the eager loop over experts depend on the routing, and the grouped
    kernel's meta function accepts bf16 only.
    """
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        empty = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
    copied = copy.deepcopy(model, memo)
    if getattr(getattr(copied, "config", None), "_experts_implementation", None) not in (None, "batched_mm"):
        copied.set_experts_implementation("batched_mm")
    return copied


def sequence_lengths(model: nn.Module, *, tp: int, images: bool = False) -> list[int]:
    """The probe's sequence lengths to try, each a multiple of ``tp``: a short one (with ``images``, that many text
    tokens beside an image's placeholders), then, for a model that refuses it (some take only lengths their chunks or
    position tables tile), the length axial position embeddings tile (Reformer trains on that length alone), the
    model's longest, and the powers of two below it, longest first."""
    config = getattr(model, "config", None)
    longest = getattr(config, "max_position_embeddings", None)
    axial = getattr(config, "axial_pos_shape", None)
    short = PROBE_TOKENS_PER_RANK * tp + (image_placeholders(model) if images else 0)
    candidates = [-(-short // tp) * tp, math.prod(axial) if getattr(config, "axial_pos_embds", False) else None]
    if isinstance(longest, int):
        candidates += [longest, *(2**power for power in range(longest.bit_length() - 1, 2, -1))]
    lengths: list[int] = []
    for length in candidates:
        if isinstance(length, int) and length > 0 and length % tp == 0 and length not in lengths:
            lengths.append(length)
    return lengths


def image_placeholders(model: nn.Module) -> int:
    """Placeholders per image of the probe's rows: as many as a meta-device copy of ``model`` makes features of one
    image (the count :func:`forward_step` gives its rows), else as its config says."""
    with AnswerDataQuestions():  # the tower's code may ask its meta tensors for values
        measured = measured_token_count(model if _on_meta(model) else meta_copy(model))
    return measured or image_token_count(model) or 0


def _on_meta(model: nn.Module) -> bool:
    return all(tensor.is_meta for tensor in model.parameters())


def refuses_length(error: ProbeError) -> bool:
    """Whether the model rejected the probe's batch itself (a ValueError of its own code, as input checks raise),
    rather than failing in a computation: only then is another length worth a try."""
    return isinstance(error.error, ValueError)


def probe(model: nn.Module, *, tokens: int, images: bool = False) -> Trace:
    """Run one forward and backward pass of ``model`` (on the meta device) on a batch of ``tokens`` token ids per
    row, with an image each where ``images`` (see :func:`forward_step`); record every module call. Raises
    :class:`ProbeError` naming the module that failed.

    Questions the model's code asks of its tensors' values (``if mask.any():``) are answered from the values of those
    computed from the CPU's token ids and image metadata, else with zero (:mod:`.meta_values`).
    """
    count = image_placeholders(model) if images else None  # measured before the hooks: no call of it is traced
    names = {id(module): name for name, module in model.named_modules()}
    trace, running, in_backward = Trace(tokens, images=images), [], []
    flow = _ParameterUses(model, trace)
    returned_by = WeakIdKeyDictionary()  # tensor -> the innermost module whose call returned it

    def before(module: nn.Module, args: tuple, kwargs: dict) -> None:
        name = names[id(module)]
        running.append(name)
        if in_backward:
            trace.called_in_backward.add(name)
            return
        inputs = {key: value for key, value in {**dict(enumerate(args)), **kwargs}.items() if _is_tensor(value)}
        tensors = {key: _describe(value) for key, value in inputs.items()}
        sources = {key: returned_by[value] for key, value in inputs.items() if value in returned_by}
        trace.calls.setdefault(name, []).append(Call(tensors, torch.is_grad_enabled(), sources))
        flow.mark_activations((args, kwargs))

    def after(module: nn.Module, args: tuple, output: Any) -> None:
        name = running.pop()
        flow.mark_activations(output)  # outputs a style turned back into local tensors, outside any recorded op
        leaves = {id(leaf) for leaf in tree_flatten(output)[0]}
        returned = tuple(key for key, param in module.named_parameters(recurse=False) if id(param) in leaves)
        if returned:
            trace.returned_parameters[name] = returned
        for leaf in tree_flatten(output)[0]:
            if _is_tensor(leaf) and leaf not in returned_by:
                returned_by[leaf] = name

    with _hooks(model, before, after), AnswerDataQuestions():
        with flow:
            try:
                output = forward_step(model, tokens=tokens, images=images, count=count)
            except Exception as error:  # noqa: BLE001 - any failure of the model's code is what the probe reports
                raise ProbeError(list(running), error, trace) from error
        running.clear()
        in_backward.append(True)
        try:
            _backward(output)
        except Exception as error:  # noqa: BLE001
            raise ProbeError([], error, trace) from error
    return trace


def forward_step(model: nn.Module, *, tokens: int, images: bool = False, count: int | None = None) -> Any:
    """The forward of a training step of ``model`` on the meta device: ``PROBE_ROWS`` rows of ``tokens`` token ids,
    no key/value cache. With ``images``, each row holds an image, its pixels, placeholders and metadata on the CPU,
    where the model's code reads their values (see :func:`~lightning_automodel.hf.vision.image_inputs.image_inputs`).
    Run it under :class:`AnswerDataQuestions`, which moves them to the meta device with their values beside them."""
    if images:
        inputs = image_inputs(model, rows=PROBE_ROWS, tokens=tokens, count=count)
    else:
        inputs = {"input_ids": torch.zeros(PROBE_ROWS, tokens, dtype=torch.long, device="meta")}
    return model(**inputs, **_no_cache(model))


@contextmanager
def _hooks(model: nn.Module, before, after) -> Iterator[None]:
    """Hooks on every module, registered last: they see the inputs a parallel style has already converted."""
    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(module.register_forward_hook(after))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _no_cache(model: nn.Module) -> dict[str, bool]:
    """Training steps build no key/value cache; ask the model not to, where its forward takes the flag."""
    config = getattr(model, "config", None)
    return {"use_cache": False} if getattr(config, "use_cache", None) is not None else {}


def _backward(output: Any) -> None:
    logits = getattr(output, "logits", None)
    if logits is None:
        leaves, _ = tree_flatten(output)
        logits = next((leaf for leaf in leaves if isinstance(leaf, torch.Tensor)), None)
    if logits is None or not logits.requires_grad:
        return
    local = logits.to_local() if isinstance(logits, DTensor) else logits
    local.float().sum().backward()


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _describe(tensor: torch.Tensor) -> TensorArg:
    if isinstance(tensor, DTensor):
        return TensorArg(tuple(tensor.to_local().shape), tuple(tensor.shape))
    return TensorArg(tuple(tensor.shape))


class _ParameterUses(TorchDispatchMode):
    """Follows the forward's data: tensors computed from the activations, tensors computed from plain parameters
    alone (``softplus(alpha)``, ``A_log.exp()``), and every operation where the two meet, whose output shape it
    records for each parameter involved (see :attr:`Trace.uses`)."""

    def __init__(self, model: nn.Module, trace: Trace) -> None:
        super().__init__()
        self.trace = trace
        self.activations = WeakIdKeyDictionary()
        self.from_parameters = WeakIdKeyDictionary()  # tensor -> names of the parameters it was computed from
        for name, param in model.named_parameters():
            if not isinstance(param, DTensor):
                self.from_parameters[param] = frozenset({name})

    def mark_activations(self, values: Any) -> None:
        for leaf in tensor_leaves(values):
            self.activations[leaf] = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        inputs, outputs = tensor_leaves((args, kwargs)), tensor_leaves(output)
        parameters = frozenset().union(*(self.from_parameters.get(t, frozenset()) for t in inputs))
        if any(t in self.activations for t in inputs):
            for tensor in outputs:
                self.activations[tensor] = True
            for name in sorted(parameters):  # one order on every rank (a set of strings has none)
                self.trace.uses.setdefault(name, []).append(tuple(outputs[0].shape) if outputs else ())
        elif parameters:
            for tensor in outputs:
                self.from_parameters[tensor] = parameters
        return output


def tensor_leaves(values: Any) -> list[torch.Tensor]:
    """The tensors in a nest of tuples, lists and dicts (an operation's arguments, a module's outputs)."""
    return [leaf for leaf in tree_flatten(values)[0] if isinstance(leaf, torch.Tensor)]


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[0][:300] if lines else ""
