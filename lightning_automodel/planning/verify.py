"""``verify_plan``: a tensor-parallel plan checked by numbers, on a shrunk replica of the model, in seconds on CPU.

A plan can run and still train wrong: a parameter acting on sharded activations whose gradient is never summed over
tp, a fused projection split across its parts. Nothing crashes; the loss just goes down more slowly. The only proof
is the numbers, so :func:`verify_plan` builds a replica of the same class from a shrunk config
(:mod:`lightning_automodel.hf.shrink`: hidden 16 per head, a few heads divisible by tp, one layer of each kind,
vocabulary 128, dropout off), runs one fp32 step of it in one process and one tensor-parallel step through the
strategy's own flow (built on the meta device, the checks, plan and probe of ``parallelize``, then allocated and
given the reference's weights shard by shard), and compares loss, logits and every parameter's gradient as full
tensors.

The tensor-parallel ranks are simulated in this process (:mod:`.simulation`): no port, no process group. FSDP2 is
left out: torch's simulation cannot run it, and it shards each rank's copy only to gather it back whole, changing no
number the plan decides. Inside distributed training, where a process group already exists, the replica runs in a
child process instead, the same on every rank and with no collective on the job's process groups: every rank gets
the same verdict (the step is seeded and deterministic) and raises the same error, and none can wait on another.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from lightning_automodel.hf.initialization import copy_shard
from lightning_automodel.hf.shrink import heads_for, shrunk_config
from lightning_automodel.hf.ties import to_empty_tied
from lightning_automodel.parallel.mesh import ParallelDims, tp_mesh
from lightning_automodel.parallel.parallelizer import check_before_collectives
from lightning_automodel.parallel.tensor.apply import apply_tensor_parallel
from lightning_automodel.parallel.tensor.plans import _FAMILY_PLANS, PlanSpec
from lightning_automodel.planning.simulation import fake_world, rank_values, simulated_ranks

# fp32: tensor parallel changes only the order of reductions (measured errors ~1e-6); a wrong plan is off by O(1).
FP32_TOLERANCE = 2e-5
# Gradients below this share of the model's largest are zero up to rounding: a gradient zero in exact arithmetic (a
# key bias before a softmax) holds rounding noise only, which relative to itself is of order 1 whatever the layout.
ZERO_GRADIENT = 1e-5
# A gradient's limit from rounding (see gradient_limits): a multiple of the single process's own fp32 error, at most
# the ceiling (a missing reduction gives errors of order 1).
ROUNDING_MARGIN, ROUNDING_CEILING = 4, 1e-3
BATCH_SIZE, SEQ_LEN = 4, 16
SHOWN = 8  # gradients listed in the table, worst first


@dataclass
class PlanVerification:
    """What :func:`verify_plan` measured: errors relative to each tensor's largest single-process value (the
    largest over the simulated ranks), per parameter for the gradients; ``problems`` are mismatches of shape or of
    which parameters get a gradient."""

    model_name: str
    tp: int
    sp: bool
    plan_source: str
    replica_parameters: int
    loss_error: float
    logits_error: float
    grad_errors: dict[str, float]
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    tolerance: float = FP32_TOLERANCE
    grad_limits: dict[str, float] = field(default_factory=dict)  # where rounding earns more (see gradient_limits)

    @property
    def worst_gradients(self) -> list[tuple[str, float]]:
        """Parameters by gradient error, worst first (NaN counts as worst)."""
        return sorted(self.grad_errors.items(), key=lambda item: _badness(item[1]), reverse=True)

    @property
    def wrong_gradients(self) -> list[str]:
        return [name for name, error in self.worst_gradients if not error < self.limit(name)]

    def limit(self, name: str) -> float:
        return self.grad_limits.get(name, self.tolerance)

    @property
    def passed(self) -> bool:
        return (
            not self.problems
            and self.loss_error < self.tolerance
            and self.logits_error < self.tolerance
            and (not self.wrong_gradients)
        )

    def __str__(self) -> str:
        lines = [
            f"verify_plan: {self.model_name} at tp={self.tp}, sp={self.sp}, with the {self.plan_source}",
            f"replica of {self.replica_parameters:,} parameters, one fp32 step against one process"
            f" ({self.seconds:.1f} s); errors relative to each tensor's largest value:",
            *self._rows(),
            *(f"  {problem}" for problem in self.problems),
        ]
        verdict = "PASSED" if self.passed else "FAILED"
        lines.append(f"{verdict}: tolerance {self.tolerance:.0e}")
        return "\n".join(lines)

    def _rows(self) -> list[str]:
        worst = self.worst_gradients
        rows = [("loss", self.loss_error), ("logits", self.logits_error), *worst[:SHOWN]]
        width = max(len(name) for name, _ in rows)
        lines = [f"  {name:<{width}}  {error:.1e}  {self._mark(name, error)}" for name, error in rows]
        if len(worst) > SHOWN:
            lines.append(f"  ... and {len(worst) - SHOWN} more gradients, the largest error {worst[SHOWN][1]:.1e}")
        return lines

    def _mark(self, name: str, error: float) -> str:
        limit = self.limit(name)
        verdict = "ok" if error < limit else "WRONG"
        return verdict if limit == self.tolerance else f"{verdict} (limit {limit:.0e}: its fp32 rounding)"

    def failure_message(self) -> str:
        """What is wrong, where, and what to do about it; the table follows."""
        found = [*self.problems]
        found += [f"{name} {error:.1e}" for name, error in (("loss", self.loss_error), ("logits", self.logits_error))
                  if not error < self.tolerance]  # fmt: skip
        wrong = self.wrong_gradients
        if wrong:
            shown = ", ".join(f"{name} ({self.grad_errors[name]:.1e})" for name in wrong[:4])
            found.append(f"the gradients of {len(wrong)} parameters, worst {shown}")
        return (
            f"The {self.plan_source} trains {self.model_name} wrong at tp={self.tp}, sp={self.sp}: one"
            f" tensor-parallel step of a shrunk replica differs from one process in {'; '.join(found)} (tolerance"
            f" {self.tolerance:.0e}, relative). {FIX}\n{self}"
        )


# What a failed verification advises.
FIX = (
    "A parameter whose gradient alone is wrong usually computes on activations the plan splits (a per-head norm, a"
    " fused projection split across its parts). Pass tp_plan= with styles that fit those modules (or that leave their"
    " projections whole, with allow_unsharded_linears=True), or register a plan for the class with register_tp_plan"
    " and verify it again; or use tp=1."
)


def verify_plan(
    model_or_config: Any,
    *,
    tp: int = 2,
    sp: bool = False,
    tp_plan: PlanSpec | None = None,
    allow_unsharded_linears: bool = False,
    raise_on_failure: bool = True,
) -> PlanVerification:
    """Verify the tensor-parallel plan ``parallelize`` gives ``model_or_config`` (a Hugging Face model, on any
    device, or its config) with these options, on a shrunk replica of the same class; see the module's docstring.

    A plan ``parallelize`` refuses is refused here with the same error. ``raise_on_failure``: raise a ValueError
    naming the worst parameters and the fix when the numbers differ; otherwise return the verification either way.
    Inside a process group the job goes to a child process: ``tp_plan`` must then pickle (a dict of styles, an
    import path, or a function importable by its module's name).
    """
    if tp < 2:
        raise ValueError(f"verify_plan checks a tensor-parallel plan: tp={tp} has none; pass tp=2 or more.")
    model_class, config = _class_and_config(model_or_config)
    job = dict(
        model_class=model_class,
        config=shrunk_config(config, heads=heads_for(tp)),
        tp=tp,
        sp=sp,
        tp_plan=tp_plan,
        allow_unsharded_linears=allow_unsharded_linears,
    )
    verification = _in_child_process(job) if dist.is_initialized() else verify_replica(**job)
    if raise_on_failure and not verification.passed:
        raise ValueError(verification.failure_message())
    return verification


def verify_replica(
    *,
    model_class: type[nn.Module] | None,
    config: Any,
    tp: int,
    sp: bool,
    tp_plan: PlanSpec | None,
    allow_unsharded_linears: bool,
) -> PlanVerification:
    """One step of a model built from ``config`` (already small) in one process and over ``tp`` simulated ranks."""
    start = time.perf_counter()
    build = _builder(model_class, config)
    with torch.device("meta"):
        model = build()
    with fake_world(tp), _one_thread():
        mesh = ParallelDims(tp=tp).resolve(tp).build_mesh("cpu")
        # Refusals first, as in training. The checks only propagate shapes on the meta device: rank 0's view serves.
        planned = check_before_collectives(
            model, mesh, sp=sp, tp_plan=tp_plan, allow_unsharded_linears=allow_unsharded_linears
        ).planned
        torch.manual_seed(0)
        reference = build()
        tokens, labels = token_batch(_vocabulary(reference))
        expected_loss, expected_logits = loss_and_logits(reference, tokens, labels)
        expected_loss.backward()
        limits = gradient_limits(_fp32_rounding(reference, tokens, labels))
        with simulated_ranks(tp):
            apply_tensor_parallel(model, tp_mesh(mesh), planned)
            load_weights(model, reference)
            with loss_parallel():
                loss, logits = loss_and_logits(model, tokens, labels)
                loss.backward()
            verification = PlanVerification(
                model_name=type(reference).__name__,
                tp=tp,
                sp=sp,
                plan_source=planned.choice.source,
                replica_parameters=sum(p.numel() for p in reference.parameters()),
                loss_error=relative_error(_full(loss), expected_loss.detach()),
                logits_error=relative_error(_full(logits), expected_logits.detach()),
                grad_errors={},
                grad_limits=limits,
            )
            _compare_gradients(verification, model, reference)
    verification.seconds = time.perf_counter() - start
    return verification


def gradient_limits(rounding: dict[str, float]) -> dict[str, float]:
    """The gradients whose single-process fp32 error against fp64 (``rounding``) is larger than the fp32 tolerance
    allows for, each with four times that error as its limit: gradients through sums that cancel (DiffLlama's lambda
    vectors), or zero in exact arithmetic and above the zero floor (a key projection's bias before a softmax). Both
    runs round, so their difference reaches the sum of their errors, and a layout summing in another order may round
    more: four times leaves room for both. Up to ROUNDING_CEILING: a gradient rounding more than that could hide a
    missing reduction (errors of order 1), and keeps the tolerance."""
    return {
        name: ROUNDING_MARGIN * error
        for name, error in rounding.items()
        if FP32_TOLERANCE < ROUNDING_MARGIN * error <= ROUNDING_CEILING
    }


def _fp32_rounding(reference: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Each gradient's error in ``reference`` (fp32, after its step) against an fp64 copy's; none for a model whose
    kernels take no fp64."""
    exact = fp64_copy(reference)
    exact.zero_grad(set_to_none=True)
    try:
        loss_and_logits(exact, tokens, labels)[0].backward()
    except RuntimeError:
        return {}
    expected = {name: p.grad.float() for name, p in exact.named_parameters() if p.grad is not None}
    floor = ZERO_GRADIENT * max((g.abs().max().item() for g in expected.values()), default=0.0)
    return {
        name: relative_error(p.grad, expected[name], floor=max(floor, 1e-12))
        for name, p in reference.named_parameters()
        if p.grad is not None and name in expected
    }


def fp64_copy(model: nn.Module) -> nn.Module:
    """``model`` in fp64, for measuring rounding; mixture-of-experts layers loop over their experts (the grouped
    matmul kernel takes no fp64)."""
    exact = copy.deepcopy(model).double()
    if getattr(getattr(exact, "config", None), "_experts_implementation", None) not in (None, "eager"):
        exact.set_experts_implementation("eager")
    return exact


def plan_unregistered(model: nn.Module, tp_plan: PlanSpec | None) -> bool:
    """Whether ``model``'s plan is one no family registered, which the tests do not check by class: the user's
    (``tp_plan``), or the model's own Hugging Face plan or the default one for a class without a family plan."""
    return tp_plan is not None or type(model).__name__ not in _FAMILY_PLANS


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


def relative_error(actual: torch.Tensor, expected: torch.Tensor, *, floor: float = 1e-12) -> float:
    """Largest difference on any simulated rank relative to the largest expected value, or to ``floor`` if that is
    smaller; infinite where the shapes differ (a layout that does not fit)."""
    scale = expected.abs().max().clamp_min(floor)
    errors = [
        ((value - expected).abs().max() / scale).item() if value.shape == expected.shape else math.inf
        for value in rank_values(actual)
    ]
    return max(errors, key=_badness)


def _compare_gradients(verification: PlanVerification, model: nn.Module, reference: nn.Module) -> None:
    expected = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    actual = {name: _full(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    for name in sorted(expected.keys() ^ actual.keys()):
        verification.problems.append(
            f"{name} gets a gradient {'only in one process' if name in expected else 'only with tensor parallel'}"
        )
    floor = ZERO_GRADIENT * max((g.abs().max().item() for g in expected.values()), default=0.0)
    verification.grad_errors = {
        name: relative_error(actual[name], grad, floor=max(floor, 1e-12))
        for name, grad in expected.items()
        if name in actual
    }


def _class_and_config(model_or_config: Any) -> tuple[type[nn.Module] | None, Any]:
    """The model class to replicate (None: the causal LM class transformers maps the config to) and its config."""
    from transformers import PretrainedConfig, PreTrainedModel

    if isinstance(model_or_config, PretrainedConfig):
        return None, model_or_config
    model = model_or_config.get_base_model() if hasattr(model_or_config, "get_base_model") else model_or_config
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"verify_plan needs a Hugging Face model (transformers.PreTrainedModel) or its config, got"
            f" {type(model_or_config).__name__}: it builds a shrunk replica from the config."
        )
    return type(model), model.config


def _builder(model_class: type[nn.Module] | None, config: Any) -> Callable[[], nn.Module]:
    """A function building the fp32 replica (of the current device and random state)."""
    from transformers import AutoModelForCausalLM

    def build() -> nn.Module:
        if model_class is None:
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        return model_class._from_config(config, dtype=torch.float32)

    return build


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Kernels of a model this small spend more on waking threads than on computing: measured 3x faster on one
    thread of 2 busy cores. The caller's setting is restored."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _vocabulary(model: nn.Module) -> int:
    """Token ids the model can both read and predict (CPM-Ant's embedding also holds prompt positions)."""
    rows = model.get_input_embeddings().num_embeddings
    return min(rows, getattr(model.config.get_text_config(), "vocab_size", None) or rows)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _badness(error: float) -> float:
    return math.inf if math.isnan(error) else error


def _in_child_process(job: dict[str, Any]) -> PlanVerification:
    """:func:`verify_replica` in a fresh interpreter, which has no process group (the simulation needs one of its
    own). Started with ``-c`` rather than multiprocessing's spawn, which would re-run an unguarded training script."""
    with tempfile.TemporaryDirectory() as directory:
        job_file, outcome_file = Path(directory, "job.pickle"), Path(directory, "outcome.pickle")
        job_file.write_bytes(pickle.dumps(job))
        code = "import sys; from lightning_automodel.planning.verify import _serve; _serve(*sys.argv[1:])"
        command = [sys.executable, "-c", code, str(job_file), str(outcome_file)]
        done = subprocess.run(command, env=_child_environment(), capture_output=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"verify_plan's child process failed:\n{done.stderr.decode(errors='replace')[-4000:]}")
        outcome = pickle.loads(outcome_file.read_bytes())
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def _child_environment() -> dict[str, str]:
    """This process's environment, with its import path: the child must import the code this process runs (this
    copy of the package, the module a ``tp_plan`` import path names) from where this process found it."""
    path = [str(Path(entry).resolve()) for entry in sys.path if entry]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def _serve(job_file: str, outcome_file: str) -> None:
    """The child of :func:`_in_child_process`: the verification of the job (or its refusal), pickled to a file."""
    job = pickle.loads(Path(job_file).read_bytes())
    try:
        outcome: Any = verify_replica(**job)
    except Exception as error:  # noqa: BLE001 - a refusal is an outcome, raised again in the parent
        outcome = error
    Path(outcome_file).write_bytes(pickle.dumps(outcome))
