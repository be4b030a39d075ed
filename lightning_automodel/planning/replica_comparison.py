"""One fp32 step of a shrunk replica, in one process and over simulated tensor-parallel ranks, compared as full
tensors: the batch, the loss, the reference's weights loaded shard by shard, and errors relative to each tensor's
largest value, with the share of them fp32 rounding alone explains."""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_automodel.hf.initialization import copy_shard
from lightning_automodel.hf.ties import to_empty_tied
from lightning_automodel.parallel.full_tensor import full_tensor
from lightning_automodel.planning.simulation import rank_values

# fp32: tensor parallel changes only the order of reductions (measured errors ~1e-6); a wrong plan is off by O(1).
FP32_TOLERANCE = 2e-5
# Gradients below this share of the model's largest are zero up to rounding: a gradient zero in exact arithmetic (a
# key bias before a softmax) holds rounding noise only, which relative to itself is of order 1 whatever the layout.
ZERO_GRADIENT = 1e-5
# A gradient's limit from rounding (see gradient_limits): a multiple of the single process's own fp32 error, at most
# the ceiling (a missing reduction gives errors of order 1).
ROUNDING_MARGIN, ROUNDING_CEILING = 4, 1e-3
# Draws of the rounding-sized perturbation (see rounding_perturbed_copies). One draw moves a gradient by a random
# multiple of its typical change: Apertus 1.5's alpha_p behind a sum cancelling 1856-fold moved by 2.9e-6 in draw 1
# and by 1.3e-5 to 5.0e-5 in draws 2-10, and tensor parallel moved it by 5.6e-5. The root mean square of eight draws
# (2.6e-5 there) estimates the typical change to within about a quarter (1 / sqrt(2 x 8)).
PERTURBATION_DRAWS = 8
BATCH_SIZE, SEQ_LEN = 4, 16


def replica_builder(model_class: type[nn.Module] | None, config: Any) -> Callable[[], nn.Module]:
    """A function building the fp32 replica (of the current device and random state); ``model_class`` None: the
    causal LM class transformers maps the config to."""
    from transformers import AutoModelForCausalLM

    def build() -> nn.Module:
        if model_class is None:
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        return model_class._from_config(config, dtype=torch.float32)

    return build


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Kernels of a model this small spend more on waking threads than on computing: measured 3x faster on one
    thread of 2 busy cores. The caller's setting is restored."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def vocabulary_size(model: nn.Module) -> int:
    """Token ids the model can both read and predict (CPM-Ant's embedding also holds prompt positions)."""
    rows = model.get_input_embeddings().num_embeddings
    return min(rows, getattr(model.config.get_text_config(), "vocab_size", None) or rows)


def token_batch(vocab_size: int, *, batch_size: int = BATCH_SIZE, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token labels. The last two labels of every sequence are ignored (-100), as padding would be,
    and the last two inputs are padding (0): the vocab-parallel embedding must keep padding_idx right."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, vocab_size, (batch_size, SEQ_LEN + 1), generator=generator)
    labels = tokens[:, 1:].clone()
    labels[:, -2:] = -100
    tokens[:, -2:] = 0
    return tokens[:, :-1], labels


def loss_and_logits(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy with a padding mask, so the mask path of attention runs too. In fp32, as transformers' own
    losses compute it: a bf16 loss would be rounded to 8 mantissa bits, and a mean of per-rank bf16 losses rounded
    differently. A sequence classifier gets one label per sequence."""
    logits = model(tokens, attention_mask=(tokens != 0).long()).logits.float()
    if logits.dim() == 2:
        return F.cross_entropy(logits, labels[:, 0] % logits.shape[-1]), logits
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits


def load_weights(model: nn.Module, reference: nn.Module) -> None:
    """Allocate ``model`` (parallelized on the meta device) and give it the reference's parameters and buffers,
    each rank its shards. Materializing as the strategy does would draw the same values only to be overwritten."""
    to_empty_tied(model, device="cpu")
    tensors = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            copy_shard(tensor, tensors[name].detach())


def nan_as_infinite(error: float) -> float:
    """An error to rank by: NaN counts as the worst."""
    return math.inf if math.isnan(error) else error


def relative_error(actual: torch.Tensor, expected: torch.Tensor, *, floor: float = 1e-12) -> float:
    """Largest difference on any simulated rank relative to the largest expected value, or to ``floor`` if that is
    smaller; infinite where the shapes differ (a layout that does not fit)."""
    scale = expected.abs().max().clamp_min(floor)
    errors = [
        ((value - expected).abs().max() / scale).item() if value.shape == expected.shape else math.inf
        for value in rank_values(actual)
    ]
    return max(errors, key=nan_as_infinite)


def gradient_errors(model: nn.Module, reference: nn.Module) -> tuple[dict[str, float], list[str]]:
    """Each parameter's gradient error in ``model`` against ``reference``'s, and the parameters that get a gradient
    in only one of them."""
    expected = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    actual = {name: full_tensor(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    one_sided = [
        f"{name} gets a gradient {'only in one process' if name in expected else 'only with tensor parallel'}"
        for name in sorted(expected.keys() ^ actual.keys())
    ]
    floor = _zero_gradient_floor(expected)
    errors = {
        name: relative_error(actual[name], grad, floor=floor) for name, grad in expected.items() if name in actual
    }
    return errors, one_sided


def gradient_limits(rounding: dict[str, float]) -> dict[str, float]:
    """The gradients whose single-process fp32 rounding (``rounding``: the error against fp64, or the typical
    change under rounding-sized perturbations, see :func:`worst_rounding`) is larger than the fp32 tolerance allows
    for, each with four times that error as its limit: gradients through sums that cancel (DiffLlama's lambda
    vectors; a scalar summed over many elements, as xIELU's alpha_p), recurrences that amplify rounding (Qwen3-Next's
    decay parameters), or zero in exact arithmetic and above the zero floor (a key projection's bias before a
    softmax). Both runs round, so their difference reaches the sum of their errors, and a layout summing in another
    order may round more: four times leaves room for both. At most ROUNDING_CEILING, however much a gradient rounds:
    a missing reduction gives errors of order 1."""
    return {
        name: min(ROUNDING_MARGIN * error, ROUNDING_CEILING)
        for name, error in rounding.items()
        if FP32_TOLERANCE < ROUNDING_MARGIN * error
    }


def fp32_rounding(reference: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Each gradient's error in ``reference`` (fp32, after its step) against an fp64 copy's; none for a model whose
    kernels take no fp64."""
    exact = fp64_copy(reference)
    exact.zero_grad(set_to_none=True)
    try:
        loss_and_logits(exact, tokens, labels)[0].backward()
    except RuntimeError:
        return {}
    expected = {name: p.grad.float() for name, p in exact.named_parameters() if p.grad is not None}
    floor = _zero_gradient_floor(expected)
    return {
        name: relative_error(p.grad, expected[name], floor=floor)
        for name, p in reference.named_parameters()
        if p.grad is not None and name in expected
    }


def fp32_sensitivity(reference: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Each gradient's typical change when every weight of ``reference`` moves by fp32's rounding (the root mean square
    over :func:`rounding_perturbed_copies`): how far rounding alone, amplified by the model, moves it. It measures
    what an fp64 copy cannot where the model's kernels compute in fp32 whatever their inputs (Qwen3-Next's gated
    delta rule)."""
    expected = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    floor = _zero_gradient_floor(expected)

    def changes(perturbed: nn.Module) -> dict[str, float]:
        perturbed.zero_grad(set_to_none=True)
        loss_and_logits(perturbed, tokens, labels)[0].backward()
        return {
            name: relative_error(p.grad, expected[name], floor=floor)
            for name, p in perturbed.named_parameters()
            if p.grad is not None and name in expected
        }

    try:
        return root_mean_square([changes(perturbed) for perturbed in rounding_perturbed_copies(reference)])
    except RuntimeError:  # a model that cannot be copied after a step (RecurrentGemma keeps non-leaf tensors)
        return {}


def rounding_perturbed_copies(model: nn.Module, *, draws: int = PERTURBATION_DRAWS) -> Iterator[nn.Module]:
    """``model`` perturbed by ``draws`` draws (:func:`perturb` with seeds 1 to ``draws``), each handed out before the
    next is made. One copy serves every draw, its weights, buffers and gradients reset in between: a
    deep copy of a tiny replica costs more than its step (measured 0.22 s against 0.14 s, Qwen3-MoE's)."""
    perturbed = copy.deepcopy(model)
    saved = [(tensor, tensor.detach().clone()) for tensor in [*perturbed.parameters(), *perturbed.buffers()]]
    for seed in range(1, draws + 1):
        with torch.no_grad():
            for tensor, value in saved:
                tensor.copy_(value)
        perturbed.zero_grad(set_to_none=True)
        perturb(perturbed, seed=seed)
        yield perturbed


def perturb(model: nn.Module, *, seed: int) -> None:
    """Each weight of ``model`` multiplied by 1 + e, e drawn from N(0, 2^-24) (half an fp32 unit in the last place):
    what reductions summed in another order (tensor parallel's) do to activations, as a change of the inputs."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float64) * 2**-24
            param.mul_((1 + noise).to(device=param.device, dtype=param.dtype))


def root_mean_square(measured: Sequence[dict[str, float]]) -> dict[str, float]:
    """Each gradient's root mean square over several draws of one measure (NaN if any draw is)."""
    names = {name for errors in measured for name in errors}
    return {name: math.sqrt(sum(errors.get(name, 0.0) ** 2 for errors in measured) / len(measured)) for name in names}


def worst_rounding(*measured: dict[str, float]) -> dict[str, float]:
    """Each gradient's largest rounding error of several measures (:func:`fp32_rounding`, :func:`fp32_sensitivity`)."""
    names = {name for errors in measured for name in errors}
    return {name: max(errors.get(name, 0.0) for errors in measured) for name in names}


def fp64_copy(model: nn.Module) -> nn.Module:
    """``model`` in fp64, for measuring rounding; mixture-of-experts layers loop over their experts (the grouped
    matmul kernel takes no fp64)."""
    exact = copy.deepcopy(model).double()
    if getattr(getattr(exact, "config", None), "_experts_implementation", None) not in (None, "eager"):
        exact.set_experts_implementation("eager")
    return exact


def _zero_gradient_floor(gradients: dict[str, torch.Tensor]) -> float:
    """The scale below which gradients count as zero (see ZERO_GRADIENT), at least 1e-12."""
    largest = max((g.abs().max().item() for g in gradients.values()), default=0.0)
    return max(ZERO_GRADIENT * largest, 1e-12)
