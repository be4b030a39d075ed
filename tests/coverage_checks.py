"""Coverage: any model type of transformers, parallelized on one layout as the strategy does it, against one process.

A check builds the type's tiny config (:mod:`lightning_automodel.hf.shrink`), a single-process reference from it, and
the same model on the meta device, which it parallelizes and materializes as ``AutoModelParallelStrategy`` does
(``parallelize`` with the strategy's defaults, then ``materialize_hf_model``); it then loads the reference's weights
shard by shard and compares loss, logits and every gradient. A check never raises: it returns what happened on its
rank, and :func:`classify` turns the outcomes of every rank into one verdict. ``scripts/coverage.py`` runs every type
this way; ``test_coverage.py`` runs a representative few.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import multiprocessing.connection
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from harness import free_port, init_worker, worker_context
from parity import (
    FP32_TOLERANCE,
    Outputs,
    dp_slice,
    gradient_errors,
    parallel_outputs,
    relative_error,
    single_process_outputs,
)
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import lightning_automodel
from lightning_automodel import ParallelDims, parallelize
from lightning_automodel.hf.initialization import copy_shard, materialize_hf_model
from lightning_automodel.hf.shrink import tiny_config
from lightning_automodel.parallel import decoder_layers
from lightning_automodel.parallel.mesh import data_mesh
from lightning_automodel.parallel.parallelizer import is_meta
from lightning_automodel.planning.verify import fp64_copy, gradient_limits

# Layouts of a world of two, as the strategy's arguments.
LAYOUTS = {"tp2": dict(tp=2, sp=False), "tp2_sp": dict(tp=2, sp=True), "dp_shard2": dict(tp=1, sp=False)}
WORLD_SIZE = 2
# Every collective gives up after this long, so that a hang becomes an error the classifier can see.
COLLECTIVE_TIMEOUT = timedelta(seconds=30)

PASS, WRONG, REFUSAL, CRASH, HANG, NO_TINY_CONFIG = "pass", "wrong", "refusal", "crash", "hang", "no tiny config"
VERDICTS = (PASS, WRONG, REFUSAL, CRASH, HANG, NO_TINY_CONFIG)
# Gradients below this share of the model's largest are zero up to rounding (see parity.gradient_errors).
ZERO_GRADIENT = 1e-5
# A refusal is one of these, raised by this package's code with the same message on every rank.
REFUSAL_TYPES = (ValueError, TypeError, NotImplementedError)
PACKAGE_DIR = Path(lightning_automodel.__file__).parent
# Errors of a rank that only waited for a peer which failed or hung: the cause is elsewhere.
SECONDARY_FAILURES = ("timed out", "connection closed by peer", "connection reset by peer")


@dataclass
class Reference:
    config: Any
    model: nn.Module
    outputs: Outputs
    # Each gradient's limit: the fp32 tolerance, or four times the single process's own error against fp64 where that is
    # larger, up to a ceiling (see lightning_automodel.planning.verify.gradient_limits).
    grad_limits: dict[str, float]


def coverage_check(model_type: str, layout: str, tp_plan: str | None = None) -> dict[str, Any]:
    """What happens on this rank when ``model_type`` trains one step on ``layout``: a JSON-able outcome.

    ``tp_plan``: an import path to a plan function to use instead of the one ``parallelize`` chooses (a plan the
    check must catch)."""
    try:
        reference = single_process_reference(model_type)
    except NoTinyConfig as error:
        return {"status": NO_TINY_CONFIG, "reason": str(error)}
    collectives = CollectiveCount()
    with _plan_log() as plan_log:
        stage = "build on the meta device"
        try:
            model, built = _build_as_the_strategy_advises(reference.config)
            tp, sp = LAYOUTS[layout]["tp"], LAYOUTS[layout]["sp"]
            mesh = layout_mesh(tp)
            stage = "parallelize"
            with collectives:
                parallelize(model, mesh, sp=sp, tp_plan=tp_plan)
            sharding = tp_sharding(model, trained=reference.outputs.grads.keys()) if tp > 1 else {}
            stage = "materialize"
            if built == META:
                materialize_hf_model(model, torch.device("cpu"))
            uninitialised = load_reference(model, reference.model)
            stage = "forward and backward"
            outputs = parallel_outputs(model, data_mesh(mesh))
        except Exception as error:  # noqa: BLE001 - every failure is an outcome to classify
            # Later stages follow collectives: materialization starts with a broadcast of the random state.
            late = {"build on the meta device": False, "parallelize": collectives.count > 0}.get(stage, True)
            return {"status": "raised", "stage": stage, "after_collectives": late, **describe_error(error), **plan_log}
    comparison = compare(outputs, reference, dp_slice(data_mesh(mesh), batch_size=4))
    build = {} if built == META else {"build": built}
    return {"status": "ran", **comparison, "uninitialised_buffers": uninitialised, **sharding, **plan_log, **build}


META = "meta"
# A model whose constructor makes real tensors under the meta device (XLNet's torch.FloatTensor parameters) is refused
# by is_meta with the fix to build it with real weights; the check follows that fix.
REAL = "with real weights: its constructor makes real matrices under the meta device, which the strategy refuses"


def _build_as_the_strategy_advises(config: Any) -> tuple[nn.Module, str]:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    try:
        is_meta(model)
    except ValueError:
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(copy.deepcopy(config)), REAL
    return model, META


class NoTinyConfig(Exception):
    """The type has no tiny config that builds and trains in one process: transformers' limit, not ours."""


@functools.lru_cache(maxsize=1)  # the three layouts of a type run one after another against the same reference
def single_process_reference(model_type: str) -> Reference:
    from transformers import AutoModelForCausalLM

    stage = "config"
    try:
        config = tiny_config(model_type)
        stage = "build"
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
        stage = "single-process step"
        outputs = single_process_outputs(model)
        return Reference(config, model, outputs, grad_limits_of(model, outputs))
    except Exception as error:  # noqa: BLE001 - transformers' own failures, reported as such
        raise NoTinyConfig(f"{stage}: {type(error).__name__}: {_first_line(error)}") from error


def grad_limits_of(model: nn.Module, outputs: Outputs) -> dict[str, float]:
    """The largest error each gradient may have (see :func:`lightning_automodel.planning.verify.gradient_limits`),
    from one step of an fp64 copy; the fp32 tolerance alone for a model whose kernels take no fp64."""
    try:
        exact = single_process_outputs(fp64_copy(model))
    except RuntimeError:
        return dict.fromkeys(outputs.grads, FP32_TOLERANCE)
    loosened = gradient_limits(gradient_errors(outputs, exact, floor=ZERO_GRADIENT))
    return {name: loosened.get(name, FP32_TOLERANCE) for name in outputs.grads}


@functools.cache
def layout_mesh(tp: int) -> DeviceMesh:
    """One mesh per tp size for the whole process: process groups are not free, and every check reuses them."""
    return ParallelDims(tp=tp).resolve(dist.get_world_size()).build_mesh("cpu", timeout=COLLECTIVE_TIMEOUT)


def load_reference(model: nn.Module, reference: nn.Module) -> list[str]:
    """Copy the reference's weights into ``model``, each rank its shards, and its buffers; return the buffers that
    materialization left different from the reference's (a meta-device build would train with those)."""
    parameters = dict(reference.named_parameters(remove_duplicate=False))
    buffers = dict(reference.named_buffers(remove_duplicate=False))
    uninitialised = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            copy_shard(param, parameters[name].detach())
        for name, buffer in model.named_buffers():
            expected = buffers[name]
            if not _equal(_full(buffer), expected):
                uninitialised.append(name)
                copy_shard(buffer, expected)
    return uninitialised


def tp_sharding(model: nn.Module, *, trained: Sequence[str]) -> dict[str, Any]:
    """How much of the model tensor parallelism split: the share of the decoder blocks' weight elements (those
    that train in a text-only step) sharded over tp, and whether the embedding and lm_head are."""
    names = {id(p): name for name, p in model.named_parameters()}
    block_params = {id(p): p for block in decoder_layers(model) for p in block.parameters() if names[id(p)] in trained}
    total = sum(p.numel() for p in block_params.values())
    sharded = sum(p.numel() for p in block_params.values() if sharded_over_tp(p))
    output = model.get_output_embeddings()
    return {
        "sharded": sharded / total if total else None,
        "embedding_sharded": sharded_over_tp(model.get_input_embeddings().weight),
        "lm_head_sharded": output is not None and sharded_over_tp(output.weight),
    }


def sharded_over_tp(param: torch.Tensor) -> bool:
    names = param.device_mesh.mesh_dim_names or () if isinstance(param, DTensor) else ()
    return "tp" in names and isinstance(param.placements[names.index("tp")], Shard | _StridedShard)


def compare(outputs: Outputs, reference: Reference, rank_slice: slice) -> dict[str, Any]:
    """The errors of the loss, this rank's logits and every gradient; the gradient furthest off for its limit, and
    whether any exceeds its limit (see :class:`Reference`)."""
    expected = reference.outputs
    try:
        grads = gradient_errors(outputs, expected, floor=ZERO_GRADIENT)
        errors = {
            "loss": relative_error(outputs.loss, expected.loss),
            "logits": relative_error(outputs.logits, expected.logits[rank_slice]),
            "grad": max(grads.values()),
        }
    except AssertionError as mismatch:  # shapes, or which parameters get a gradient
        return {"errors": {}, "mismatch": str(mismatch)}
    share = {name: error / reference.grad_limits[name] for name, error in grads.items()}
    worst = max(share, key=lambda name: math.inf if math.isnan(share[name]) else share[name])
    loosened = {name: limit for name, limit in reference.grad_limits.items() if limit > FP32_TOLERANCE}
    within = all(value < 1 for value in share.values())  # NaN is not
    return {"errors": errors, "worst_grad": worst, "grads_within_limits": within, "loosened_limits": loosened}


def classify(outcomes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One verdict from every rank's outcome of a check: pass, wrong, refusal, crash, hang or no tiny config,
    with a one-line detail and, for a pass, how much tensor parallelism sharded."""
    statuses = {outcome["status"] for outcome in outcomes}
    first = outcomes[0]
    if statuses == {NO_TINY_CONFIG}:
        return {"verdict": NO_TINY_CONFIG, "detail": first["reason"]}
    if statuses == {"ran"}:
        return _judge_numbers(outcomes)
    raised = [(rank, o) for rank, o in enumerate(outcomes) if o["status"] == "raised"]
    if len(raised) < len(outcomes):
        rank, outcome = raised[0]
        return {"verdict": CRASH, "detail": f"raised on rank {rank} only: {_error_line(outcome)}"}
    if all(o["secondary"] == "timed out" for o in outcomes):
        return {"verdict": HANG, "detail": f"every rank timed out in a collective ({first['stage']})"}
    errors = {(o["error"], o["message"]) for o in outcomes}
    if len(errors) == 1 and first["ours"] and first["clear"]:
        detail = f"{first['error']}: {first['message']}"
        return {"verdict": REFUSAL, "detail": detail, "after_collectives": first["after_collectives"]}
    if len(errors) == 1:
        return {"verdict": CRASH, "detail": _error_line(first)}
    rank, cause = next(((r, o) for r, o in raised if not o["secondary"]), raised[0])
    return {"verdict": CRASH, "detail": f"rank {rank}: {_error_line(cause)}; the other ranks then failed too"}


def _judge_numbers(outcomes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Pass or wrong by the numbers; buffers the meta-device build left uninitialised are a note beside them (the
    numbers were taken with the reference's buffers copied in)."""
    first = outcomes[0]
    found = {key: first.get(key) for key in ("sharded", "embedding_sharded", "lm_head_sharded", "plan")}
    if first.get("loosened_limits"):
        found["loosened_limits"] = first["loosened_limits"]
    if "build" in first:
        found["build"] = first["build"]
    if first["uninitialised_buffers"]:
        found["note"] = f"meta-device build leaves buffers uninitialised: {', '.join(first['uninitialised_buffers'])}"
    mismatch = next((o["mismatch"] for o in outcomes if "mismatch" in o), None)
    if mismatch is not None:
        return {"verdict": WRONG, "detail": mismatch, **found}
    worst = next((o for o in outcomes if not o["grads_within_limits"]), outcomes[0])
    errors = {key: max(o["errors"][key] for o in outcomes) for key in worst["errors"]}
    problems = [f"{key} {errors[key]:.1e}" for key in ("loss", "logits") if not errors[key] < FP32_TOLERANCE]  # NaN too
    if not all(o["grads_within_limits"] for o in outcomes):
        problems.append(f"grad {errors['grad']:.1e} ({worst['worst_grad']})")
    return {"verdict": WRONG if problems else PASS, "detail": ", ".join(problems), "errors": errors, **found}


def describe_error(error: BaseException) -> dict[str, Any]:
    """The error as data: its type, first line, where it was raised, and whether it is a clear refusal of ours."""
    frame = traceback.extract_tb(error.__traceback__)[-1]
    site = Path(frame.filename)
    ours = PACKAGE_DIR in site.parents
    shown = site.relative_to(PACKAGE_DIR.parent) if ours else Path(*site.parts[-3:])
    message = _first_line(error)
    return {
        "error": type(error).__name__,
        "message": message,
        "site": f"{shown}:{frame.lineno}",
        "ours": ours,
        "clear": isinstance(error, REFUSAL_TYPES),
        "secondary": next((what for what in SECONDARY_FAILURES if what in message.lower()), None),
    }


def _error_line(outcome: dict[str, Any]) -> str:
    return f"{outcome['error']}: {outcome['message']} (in {outcome['stage']}, at {outcome['site']})"


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[0][:300] if lines else ""


class CollectiveCount(TorchDispatchMode):
    """Counts the collectives dispatched while active: a refusal should come before any, so that no rank can be
    left waiting in one. Collectives on meta tensors (the probe's, see lightning_automodel.parallel.probe) only
    propagate shapes, communicate nothing, and do not count."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            self.count += not all(t.device.type == "meta" for t in tensors)
        return func(*args, **(kwargs or {}))


def _equal(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Exactly equal, NaN and infinities included (masks hold -inf)."""
    return actual.shape == expected.shape and torch.equal(actual.nan_to_num(), expected.nan_to_num())


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@contextmanager
def _plan_log() -> Iterator[dict[str, Any]]:
    """What parallelize logs about its plan: where the plan came from, and patterns that matched nothing."""
    found: dict[str, Any] = {}

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.msg.startswith("Tensor parallel over"):
                found["plan"] = record.args[1]
            elif record.msg.startswith("Tensor-parallel plan patterns that match no module"):
                found["unmatched"] = list(record.args[1])

    logger = logging.getLogger("lightning_automodel.parallel.tensor.apply")
    handler, level = Collect(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield found
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


# The launcher: checks in launches of WORLD_SIZE processes, relaunched after whatever ends a launch.

Job = tuple[str, str]  # (model type, layout)
Check = Callable[[str, str], dict[str, Any]]
STARTUP_TIMEOUT = 300.0  # spawning processes that import torch and transformers, on two busy cores
GRACE = 5.0  # how long the other ranks get to report once one has failed
POLL = 1.0  # how often the launcher looks whether a process died
# After these every rank went through the same collectives, and the launch goes on with the next check.
CONTINUABLE = (PASS, WRONG, REFUSAL, NO_TINY_CONFIG)


def measure(
    jobs: Sequence[Job], *, job_timeout: float, check: Check = coverage_check
) -> Iterator[tuple[int, Job, dict[str, Any]]]:
    """Run ``check`` on every job (each one different) and yield (launch number, job, verdict) as each is known.

    A launch of ``WORLD_SIZE`` processes runs the jobs in order. A hang, a crash of some ranks or of a process, or
    process groups that no longer answer after a failure end it; the next launch starts at the following job.
    """
    pending, launches = list(jobs), 0
    while pending:
        launches += 1
        for job, verdict in _launch(list(pending), job_timeout=job_timeout, check=check):
            pending.remove(job)
            yield launches, job, verdict


def _launch(jobs: list[Job], *, job_timeout: float, check: Check) -> Iterator[tuple[Job, dict[str, Any]]]:
    context = worker_context()
    port = free_port()
    # One pipe per worker: a send is written before it returns, so a process that dies next loses no report.
    pipes = [context.Pipe(duplex=False) for _ in range(WORLD_SIZE)]
    workers = [
        context.Process(target=_serve, args=(rank, port, jobs, pipes[rank][1], check), daemon=True)
        for rank in range(WORLD_SIZE)
    ]
    for worker in workers:
        worker.start()
    try:
        yield from _verdicts(jobs, [reader for reader, _ in pipes], workers, job_timeout=job_timeout)
    finally:
        for worker in workers:
            worker.kill()
            worker.join()


def _verdicts(jobs: list[Job], readers, workers, *, job_timeout: float) -> Iterator[tuple[Job, dict[str, Any]]]:
    """Classify each job once every rank reported it; end the launch when a job leaves it unusable."""
    outcomes: dict[Job, list[dict | None]] = {job: [None] * WORLD_SIZE for job in jobs}
    current, deadline = jobs[0], time.monotonic() + STARTUP_TIMEOUT + job_timeout
    while True:
        ready = multiprocessing.connection.wait(readers, timeout=min(max(deadline - time.monotonic(), 0), POLL))
        if not ready:
            if time.monotonic() < deadline and all(worker.is_alive() for worker in workers):
                continue
            yield current, _stalled(outcomes[current], workers, job_timeout)
            return
        try:
            rank, job, payload = ready[0].recv()
        except EOFError:  # the process died; what it sent before is read first
            readers = [reader for reader in readers if reader is not ready[0]]
            continue
        if payload is None:  # this rank's process groups no longer answer
            if not all(outcomes[job]):  # a peer died or hangs: judge the job now, or every launch would retry it
                yield job, _stalled(outcomes[job], workers, job_timeout)
            return
        outcomes[job][rank] = payload
        if all(outcomes[job]):
            verdict = classify(outcomes[job])
            yield job, verdict
            if job == jobs[-1] or not (verdict["verdict"] in CONTINUABLE or _same_failure(outcomes[job])):
                return
        elif payload["status"] != "ran":
            deadline = min(deadline, time.monotonic() + GRACE)
        unfinished = next(job for job in jobs if not all(outcomes[job]))
        if unfinished != current:
            current, deadline = unfinished, time.monotonic() + job_timeout


def _stalled(outcomes: list[dict | None], workers, job_timeout: float) -> dict[str, Any]:
    """The verdict on a check some rank never finished: a crash if a process died or another rank failed, else a
    hang."""
    dead = [(rank, worker.exitcode) for rank, worker in enumerate(workers) if not worker.is_alive()]
    if dead:
        rank, code = dead[0]
        return {"verdict": CRASH, "detail": f"the process of rank {rank} exited with code {code}"}
    failed = [(rank, o) for rank, o in enumerate(outcomes) if o is not None and o["status"] == "raised"]
    if failed:
        rank, outcome = failed[0]
        return {
            "verdict": CRASH,
            "detail": f"raised on rank {rank} only, the others kept waiting: {_error_line(outcome)}",
        }
    waiting = [rank for rank, o in enumerate(outcomes) if o is None]
    return {"verdict": HANG, "detail": f"rank(s) {waiting} gave no result within {job_timeout:.0f} s"}


def _same_failure(outcomes: Sequence[dict[str, Any]]) -> bool:
    """Every rank raised the same error (a crash the launch survives if the process groups still answer)."""
    return all(o["status"] == "raised" for o in outcomes) and len({(o["error"], o["message"]) for o in outcomes}) == 1


def _serve(
    rank: int, port: int, jobs: Sequence[Job], reports: multiprocessing.connection.Connection, check: Check
) -> None:
    """A worker: run the jobs in order, reporting each outcome; after a failure, go on only if the process groups
    still answer (a failure that left a collective half done would garble every later check)."""
    init_worker(rank, WORLD_SIZE, port, COLLECTIVE_TIMEOUT.total_seconds())
    _quiet()
    for job in jobs:
        outcome = check(*job)
        reports.send((rank, job, outcome))
        if outcome["status"] == "raised" and not _groups_answer(LAYOUTS[job[1]]["tp"]):
            reports.send((rank, job, None))
            return
    dist.destroy_process_group()


def _groups_answer(tp: int) -> bool:
    mesh = layout_mesh(tp)
    try:
        dist.barrier()
        for dim in range(mesh.ndim):
            dist.barrier(group=mesh.get_group(dim))
    except Exception:  # noqa: BLE001 - whatever the failure, the launch must end
        return False
    return True


def _quiet() -> None:
    """Tiny configs trip transformers' warnings about sizes (token ids past the vocabulary, rope lengths), and
    torch warns of every strided redistribution: noise in a sweep of hundreds of models."""
    import warnings

    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
