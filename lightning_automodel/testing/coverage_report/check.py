"""Coverage: any model type of transformers, parallelized on one layout as the strategy does it, against one process.

A check builds the type's tiny config (:mod:`lightning_automodel.hf.shrink`, or one of
:data:`~.model_types.EXTRA_TINY_CONFIGS`), a single-process reference from it, and the same model on the meta device,
which it parallelizes and materializes as ``AutoModelParallelStrategy`` does (``parallelize`` with the strategy's
defaults, then ``materialize_hf_model``); it then loads the reference's weights shard by shard and compares loss,
logits and every gradient. A check never raises: it returns what happened on its rank, and :func:`.verdicts.classify`
turns the outcomes of every rank into one verdict. ``scripts/coverage.py`` runs every type this way
(:mod:`~lightning_automodel.testing.coverage_report.launch`); ``tests/test_coverage.py`` runs a representative few.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_automodel import ParallelDims, parallelize
from lightning_automodel.hf.decoder_layers import named_decoder_layers, named_multimodal_parts
from lightning_automodel.hf.initialization import copy_shard, materialize_hf_model
from lightning_automodel.parallel.initial_weights import is_meta
from lightning_automodel.parallel.mesh import data_mesh
from lightning_automodel.planning.replica_comparison import (
    ZERO_GRADIENT,
    fp64_copy,
    gradient_limits,
    root_mean_square,
    rounding_perturbed_copies,
    worst_rounding,
)
from lightning_automodel.testing.collectives import CollectiveCount
from lightning_automodel.testing.coverage_report.kinds import (
    KINDS,
    TEXT,
    Kind,
    NoImageInputs,
    Rows,
    rows_part,
    text_alone_error,
)
from lightning_automodel.testing.coverage_report.verdicts import (
    NO_IMAGE_INPUTS,
    NO_TINY_CONFIG,
    describe_error,
    first_line,
)
from lightning_automodel.testing.parity import (
    FP32_TOLERANCE,
    Outputs,
    assert_gradients_placed_as_parameters,
    dp_slice,
    full,
    gradient_errors,
    relative_error,
)

# Layouts of a world of two, as the strategy's arguments.
LAYOUTS = {"tp2": dict(tp=2, sp=False), "tp2_sp": dict(tp=2, sp=True), "dp_shard2": dict(tp=1, sp=False)}
WORLD_SIZE = 2
# Every collective gives up after this long, so that a hang becomes an error the classifier can see.
COLLECTIVE_TIMEOUT = timedelta(seconds=30)


@dataclass
class Reference:
    config: Any
    model: nn.Module
    outputs: Outputs
    # Each gradient's limit: the fp32 tolerance, or four times the single process's own rounding where that is larger
    # (its error against fp64, or its typical change when the weights move by rounding's size), up to a ceiling (see
    # lightning_automodel.planning.replica_comparison.gradient_limits).
    grad_limits: dict[str, float]
    rows: Rows  # the batch, as the Kind builds it


def coverage_check(model_type: str, layout: str, tp_plan: str | None = None, kind: str = TEXT.name) -> dict[str, Any]:
    """What happens on this rank when ``model_type`` (of the registry ``kind``: see :mod:`.kinds`) trains one step
    on ``layout``: a JSON-able outcome.

    ``tp_plan``: an import path to a plan function to use instead of the one ``parallelize`` chooses (a plan the
    check must catch)."""
    try:
        reference = single_process_reference(model_type, kind)
    except NoTinyConfig as error:
        return {"status": NO_TINY_CONFIG, "reason": str(error)}
    except NoImageInputs as error:
        return {"status": NO_IMAGE_INPUTS, "reason": str(error)}
    collectives = CollectiveCount()
    with _plan_log() as plan_log:
        stage = "build on the meta device"
        try:
            model, built = _build_as_the_strategy_advises(reference.config, KINDS[kind].auto_class)
            tp, sp = LAYOUTS[layout]["tp"], LAYOUTS[layout]["sp"]
            mesh = layout_mesh(tp)
            stage = "parallelize"
            with collectives:
                parallelize(model, mesh, sp=sp, tp_plan=tp_plan)
            sharding = tp_sharding(model, trained=reference.outputs.grads.keys()) if tp > 1 else {}
            dp = data_mesh(mesh)
            stage = "materialize"
            if built == META:
                materialize_hf_model(model, torch.device("cpu"))
            uninitialised = load_reference(model, reference.model)
            stage = "forward and backward"
            outputs = _parallel_outputs(model, dp, rows=reference.rows, kind=KINDS[kind])
        except Exception as error:  # noqa: BLE001 - every failure is an outcome to classify
            # Later stages follow collectives: materialization starts with a broadcast of the random state.
            late = {"build on the meta device": False, "parallelize": collectives.count > 0}.get(stage, True)
            return {"status": "raised", "stage": stage, "after_collectives": late, **describe_error(error), **plan_log}
    comparison = compare(outputs, reference, dp_slice(dp, batch_size=len(reference.rows["input_ids"])))
    build = {} if built == META else {"build": built}
    return {"status": "ran", **comparison, "uninitialised_buffers": uninitialised, **sharding, **plan_log, **build}


META = "meta"
# A model whose constructor makes real tensors under the meta device (XLNet's torch.FloatTensor parameters) is refused
# by is_meta with the fix to build it with real weights; the check follows that fix.
REAL = "with real weights: its constructor makes real matrices under the meta device, which the strategy refuses"


def _build_as_the_strategy_advises(config: Any, auto_class: Any) -> tuple[nn.Module, str]:
    with torch.device("meta"):
        model = auto_class.from_config(copy.deepcopy(config))
    try:
        is_meta(model)
    except ValueError:
        torch.manual_seed(0)
        return auto_class.from_config(copy.deepcopy(config)), REAL
    return model, META


class NoTinyConfig(Exception):
    """The type has no tiny config that builds and trains in one process: transformers' limit, not ours."""


@functools.lru_cache(maxsize=1)  # the three layouts of a type run one after another against the same reference
def single_process_reference(model_type: str, kind: str = TEXT.name) -> Reference:
    stage, of_kind = "config", KINDS[kind]
    try:
        config = of_kind.config(model_type)
        stage = "build"
        torch.manual_seed(0)
        model = of_kind.auto_class.from_config(copy.deepcopy(config))
        stage = "inputs"
        rows = of_kind.rows(model)
        stage = "single-process step"
        outputs = _outputs(model, rows, kind=of_kind)
        return Reference(config, model, outputs, grad_limits_of(model, outputs, rows=rows, kind=of_kind), rows)
    except NoImageInputs:
        raise
    except Exception as error:  # noqa: BLE001 - transformers' own failures, reported as such
        found = f"{stage}: {type(error).__name__}: {first_line(error)}"
        if stage == "inputs" and kind != TEXT.name:  # the model fails on the image inputs built for it
            text_error = text_alone_error(model)
            if text_error is None:
                raise NoImageInputs(found) from error
            found = f"single-process step on text alone: {type(text_error).__name__}: {first_line(text_error)}"
        raise NoTinyConfig(found) from error


def _outputs(model: nn.Module, rows: Rows, *, kind: Kind) -> Outputs:
    """One process's loss, logits and gradients on ``rows`` (gradients accumulate over calls)."""
    loss, logits = kind.loss_and_logits(model, rows)
    loss.backward()
    return Outputs(loss, logits, {name: p.grad for name, p in model.named_parameters() if p.grad is not None})


def _parallel_outputs(model: nn.Module, dp: DeviceMesh | None, *, rows: Rows, kind: Kind) -> Outputs:
    """This rank's logits (of its rows of the batch), the loss averaged over ``dp`` and every gradient, gathered (see
    :func:`lightning_automodel.testing.parity.parallel_outputs`, of a text batch)."""
    mine = rows_part(rows, dp_slice(dp, len(rows["input_ids"])), model=model)
    with loss_parallel():
        loss, logits = kind.loss_and_logits(model, mine)
        loss.backward()
    loss = full(loss).detach().clone()
    if dp is not None:
        dist.all_reduce(loss, group=dp.get_group())
        loss /= dp.size()
    assert_gradients_placed_as_parameters(model)
    return Outputs(
        loss, full(logits), {name: full(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    )


def grad_limits_of(model: nn.Module, outputs: Outputs, *, rows: Rows, kind: Kind) -> dict[str, float]:
    """The largest error each gradient may have (see
    :func:`lightning_automodel.planning.replica_comparison.gradient_limits`), from the worst of two measures of its
    fp32 rounding: one step of an fp64 copy, and the root mean square over steps of copies whose weights moved by
    rounding's size (see :func:`~lightning_automodel.planning.replica_comparison.fp32_sensitivity`); the tolerance
    alone where neither copy runs."""
    measured = []
    for copies in (lambda: [fp64_copy(model)], lambda: rounding_perturbed_copies(model)):
        try:
            draws = [_rounding_errors(outputs, replica, rows=rows, kind=kind) for replica in copies()]
        except RuntimeError:  # kernels without fp64; a model that cannot be copied after a step (RecurrentGemma)
            continue
        measured.append(root_mean_square(draws))
    loosened = gradient_limits(worst_rounding(*measured))
    return {name: loosened.get(name, FP32_TOLERANCE) for name in outputs.grads}


def _rounding_errors(outputs: Outputs, replica: nn.Module, *, rows: Rows, kind: Kind) -> dict[str, float]:
    """Each gradient of ``outputs`` against one step of ``replica`` (an fp64 or a perturbed copy)."""
    return gradient_errors(outputs, _outputs(replica, rows, kind=kind), floor=ZERO_GRADIENT)


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
            if not _equal(full(buffer), expected):
                uninitialised.append(name)
                copy_shard(buffer, expected)
    return uninitialised


def tp_sharding(model: nn.Module, *, trained: Sequence[str]) -> dict[str, Any]:
    """How much of the model tensor parallelism split: the share of the blocks' weight elements (those that train in
    the check's step; a vision tower's blocks included) sharded over tp, the same of the tower's blocks alone (a
    model with one), and whether the embedding and lm_head are."""
    names = {id(p): name for name, p in model.named_parameters()}
    blocks = {
        id(p): p for _, block in named_decoder_layers(model) for p in block.parameters() if names[id(p)] in trained
    }
    output = model.get_output_embeddings()
    found = {
        "sharded": _share_sharded(blocks.values()),
        "embedding_sharded": sharded_over_tp(model.get_input_embeddings().weight),
        "lm_head_sharded": output is not None and sharded_over_tp(output.weight),
    }
    tower = tuple(f"{name}." for name, _ in named_multimodal_parts(model))
    if tower:
        found["tower_sharded"] = _share_sharded([p for key, p in blocks.items() if names[key].startswith(tower)])
    return found


def _share_sharded(params: Iterable[torch.Tensor]) -> float | None:
    params = list(params)
    total = sum(p.numel() for p in params)
    return sum(p.numel() for p in params if sharded_over_tp(p)) / total if total else None


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


def _equal(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Exactly equal, NaN and infinities included (masks hold -inf)."""
    return actual.shape == expected.shape and torch.equal(actual.nan_to_num(), expected.nan_to_num())


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
            elif record.msg.startswith("Beside the language model, kept whole"):
                found["kept_whole"] = dict(record.args)  # a lone mapping is the record's args

    logger = logging.getLogger("lightning_automodel.parallel.tensor.apply")
    handler, level = Collect(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield found
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
