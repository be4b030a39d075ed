"""The activation estimate (planning.memory.activations) vs the peak a real training step reaches on CPU, per rank, for
each activation-checkpointing mode, tensor and sequence parallel, FSDP2, context parallel, pipeline parallel under
each of its schedules and a bf16 mixed-precision policy; and the plan report's lines built on it."""

import contextlib
from functools import partial

import pytest
import torch
from memory_checks import MEMORY_MODEL, measured_activation_bytes
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from lightning_automodel import ParallelDims, plan_report
from lightning_automodel.parallel.pipeline import PipelineOptions
from lightning_automodel.planning.memory import activations as memory
from lightning_automodel.planning.memory.activations import activation_bytes
from lightning_automodel.planning.memory.layer_extrapolation import alike_layers, over_layers
from lightning_automodel.testing.harness import run_checks
from lightning_automodel.testing.models import tiny_config

ROWS, TOKENS = 4, 256
BF16_MIXED = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# The issue asks for 15%; the estimate runs the step's own code, and lands within 0.2% of the measured peak of every
# layout without pp, within 1.2% of those under pp on two ranks but the zero-bubble schedule's, 2.3-2.9% above: the
# resident set misses the pages of tensors never written, which torch's tensor count does not (a real-tensor step,
# tracked as the estimate tracks its own, comes out 3% above it too). See the README for each.
TOLERANCE = 0.02
ZERO_BUBBLE_TOLERANCE = 0.04
FOUR_RANK_TOLERANCE = 0.03  # four processes on two cores: one run measured two ranks of one stage 2.2% apart
LAYOUTS = [
    (ParallelDims(dp_shard=2), dict(activation_checkpointing=False)),
    (ParallelDims(tp=2), dict(sp=True)),
    (ParallelDims(cp=2), dict(activation_checkpointing=False)),
    (ParallelDims(dp_shard=2), dict(activation_checkpointing="selective", mp_policy=BF16_MIXED)),
    # Each pp rank holds the micro-batches its schedule keeps in flight: 1F1B as many as stages from it on (GPipe all of
    # them, the interleaved schedules theirs: -m sweep).
    (ParallelDims(pp=2), dict(pipeline=PipelineOptions(schedule="1F1B", microbatches=4))),
]
SWEEP_LAYOUTS = [
    (ParallelDims(tp=2), dict(activation_checkpointing="full")),
    (ParallelDims(pp=2), dict(mp_policy=BF16_MIXED, pipeline=PipelineOptions(microbatches=2))),  # bf16 hand-over
    (ParallelDims(pp=2), dict(pipeline=PipelineOptions(schedule="GPipe", microbatches=4))),
    (ParallelDims(pp=2), dict(pipeline=PipelineOptions(schedule="Interleaved1F1B", stages_per_rank=2, microbatches=4))),
    (
        ParallelDims(pp=2),
        dict(pipeline=PipelineOptions(schedule="InterleavedZeroBubble", stages_per_rank=2, microbatches=4)),
    ),
    (ParallelDims(dp_shard=2), dict(activation_checkpointing="selective")),
    (ParallelDims(dp_shard=2), dict(activation_checkpointing="submodule")),
    (ParallelDims(dp_shard=2), dict(activation_checkpointing="full")),
    (ParallelDims(pp=2), dict(activation_checkpointing="full", pipeline=PipelineOptions(microbatches=2))),
    # lm_head and the loss a quarter of the sequence at a time: since the merge of the optimizer step's estimate
    # (3b79381) the real step's resident peak measures 56.3 MB against the estimate's 82.2 MB (unchanged), where
    # either side of the merge alone measures 82 MB: open (docs/planning.md).
    (ParallelDims(tp=2), dict(sp=True, loss_chunks=4)),
]
# Stages handing each other sequence shards (tp + sp) and FSDP2 holding a stage's gradients unsharded until the last
# micro-batch (dp_shard).
FOUR_RANK_SWEEP_LAYOUTS = [
    (ParallelDims(tp=2), dict(activation_checkpointing="full")),
    (ParallelDims(pp=2), dict(mp_policy=BF16_MIXED, pipeline=PipelineOptions(microbatches=2))),  # bf16 hand-over
    (ParallelDims(pp=2, cp=2), dict(pipeline=PipelineOptions(microbatches=4))),  # a stage receives its cp share
    (ParallelDims(pp=2, tp=2), dict(sp=True, pipeline=PipelineOptions(microbatches=4))),
    (
        ParallelDims(pp=2, dp_shard=2),
        dict(activation_checkpointing="selective", pipeline=PipelineOptions(schedule="GPipe", microbatches=2)),
    ),
]


def _on_meta(family: str = "llama", **overrides):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(family, **overrides))


def test_estimate_matches_the_measured_peak_of_every_layout():
    _assert_estimates_match_measured_peaks(LAYOUTS)


@pytest.mark.sweep
def test_estimate_matches_the_measured_peak_of_more_layouts():
    _assert_estimates_match_measured_peaks(SWEEP_LAYOUTS)


@pytest.mark.sweep
def test_estimate_matches_the_measured_peak_of_pipelines_on_four_ranks():
    _assert_estimates_match_measured_peaks(FOUR_RANK_SWEEP_LAYOUTS, world_size=4)


def _assert_estimates_match_measured_peaks(layouts, *, world_size: int = 2) -> None:
    checks = [partial(measured_activation_bytes, dims, ROWS, TOKENS, **options) for dims, options in layouts]
    measured = run_checks(world_size, checks, timeout=600)
    for (dims, options), per_rank in zip(layouts, measured.values(), strict=True):
        dims = dims.resolve(world_size)
        pipeline = options.get("pipeline")
        tolerance = TOLERANCE if world_size == 2 else FOUR_RANK_TOLERANCE
        if pipeline is not None and pipeline.splits_backward():
            tolerance = ZERO_BUBBLE_TOLERANCE
        estimates = {}  # by pp rank: the ranks of a stage hold alike
        for rank, peak in enumerate(per_rank):
            pp_rank = rank // dims.ranks_per_stage
            if pp_rank not in estimates:
                model = _on_meta(vocab_size=8000, **MEMORY_MODEL)
                shape = dict(micro_batch=ROWS, seq_len=TOKENS, rank=rank)
                estimates[pp_rank] = activation_bytes(model, dims, **shape, **options)
            assert estimates[pp_rank] == pytest.approx(peak, rel=tolerance), (dims, options, rank, estimates, peak)


def test_the_report_estimates_every_mode():
    """Off keeps every activation, full each layer's input; selective (the matmuls' outputs) and submodule (the
    norms' and residuals') lie between, in an order the shapes decide."""
    model = _on_meta(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=2)
    report = plan_report(model, ParallelDims(tp=2).resolve(4), sp=True, batch_shape=(2, 128))
    sizes = report.activation_bytes
    assert list(sizes) == ["off", "selective", "submodule", "full"]
    assert sizes["off"] > max(sizes["selective"], sizes["submodule"])
    assert min(sizes["selective"], sizes["submodule"]) > sizes["full"] > 0
    text = str(report)
    assert "activations per rank, 2 rows x 128 tokens a step" in text
    assert "(activations not included)" not in text


def test_the_report_estimates_each_pipeline_stage():
    """Each pp rank's stage is estimated; the report's figure per mode is the stage whose total is the largest (the
    last: it holds the logits), and a zero-bubble schedule, which runs no checkpointing, is estimated without."""
    model = _on_meta(vocab_size=2048, num_hidden_layers=4)
    report = plan_report(model, ParallelDims(pp=2).resolve(2), batch_shape=(4, 64))
    first, last = report.stages
    assert list(report.activation_bytes) == list(first.activation_bytes) == ["off", "selective", "submodule", "full"]
    for mode, size in report.activation_bytes.items():
        assert size == last.activation_bytes[mode] > first.activation_bytes[mode] > 0
        assert report.total_bytes(mode) == last.training_bytes_per_rank + size
    assert "(pp ranks: " in str(report)
    zero_bubble = PipelineOptions(schedule="InterleavedZeroBubble", stages_per_rank=2)
    report = plan_report(model, ParallelDims(pp=2).resolve(2), pipeline=zero_bubble, batch_shape=(4, 64))
    assert list(report.activation_bytes) == ["off"]


@pytest.mark.parametrize(
    "layers, dims, pipeline, rank, splits",
    [
        (23, ParallelDims(pp=2, dp_shard=2).resolve(4), PipelineOptions(), 3, [[1, 3], [1, 4], [1, 5]]),
        pytest.param(  # two stages per rank: its stages cut alike (1F1B over dp_shard in the default run)
            46,
            ParallelDims(pp=2).resolve(2),
            PipelineOptions(schedule="Interleaved1F1B", stages_per_rank=2),
            0,
            [[3, 1, 4, 1], [4, 1, 5, 1], [5, 1, 6, 1]],
            marks=pytest.mark.sweep,
        ),
    ],
)
def test_the_stages_of_many_alike_layers_are_extrapolated_exactly(layers, dims, pipeline, rank, splits, monkeypatch):
    """Under pp a rank steps its own stages only: they are cut, each by as many layers, to three, four and five layers
    in the smallest (the other stages to one layer each), and the peak extrapolated agrees to the byte with the step of
    the model whole: the last of two stages of 23 layers (11 and 12), and pp rank 0 of 46 layers in four stages under
    Interleaved1F1B (stages 0 and 2, of 11 and 12)."""
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers)
    step = dict(dims=dims, micro_batch=2, seq_len=32, rank=rank, pipeline=pipeline)
    whole = memory._step_peak(_on_meta(**shape), **step)
    stepped, step_peak = [], memory._step_peak

    def counted(model, **kw):
        stepped.append(list(kw["pipeline"].layers_per_stage))
        return step_peak(model, **kw)

    monkeypatch.setattr(memory, "_step_peak", counted)
    assert activation_bytes(_on_meta(**shape), **step) == whole
    assert stepped == splits


@pytest.mark.parametrize(
    "family, dims, options",
    [
        ("llama", ParallelDims(dp_shard=2), dict(activation_checkpointing="selective")),
        pytest.param("qwen3", ParallelDims(tp=2, dp_shard=1), dict(sp=True), marks=pytest.mark.sweep),
    ],
)
def test_many_alike_layers_are_extrapolated_exactly(family, dims, options, monkeypatch):
    """Eleven alike layers are estimated from three, four and five (and only from them); the step of all eleven
    agrees to the byte. Under selective checkpointing and FSDP2 the second layer adds more than the later ones: two and
    three would not do."""
    shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=11)
    step = dict(dims=dims.resolve(2), micro_batch=2, seq_len=64, **options)
    whole = memory._step_peak(_on_meta(family, **shape), rank=0, **step)
    stepped, step_peak = [], memory._step_peak
    monkeypatch.setattr(
        memory, "_step_peak", lambda model, **kw: stepped.append(len(alike_layers(model))) or step_peak(model, **kw)
    )
    assert activation_bytes(_on_meta(family, **shape), **step) == whole
    assert stepped == [3, 4, 5]


def test_layers_of_several_kinds_are_measured_whole():
    """Sliding-window layers between full-attention ones, or layers some of which skip rotary embeddings, may hold
    other activations: no extrapolation."""
    assert alike_layers(_on_meta("llama", num_hidden_layers=11)) is not None
    assert alike_layers(_on_meta("gemma3", num_hidden_layers=11)) is None
    no_rope = _on_meta("llama", num_hidden_layers=11)
    no_rope.config.no_rope_layers = [1] * 7 + [0] + [1] * 3
    assert alike_layers(no_rope) is None


def test_layers_in_a_prefetch_window_are_not_extrapolated_from(monkeypatch):
    """With FSDP2 gathering four layers ahead in backward, a few layers each add a gathered layer as well: the few
    measured lie beyond the window (here, so far that the whole model is stepped)."""
    stepped = []
    monkeypatch.setattr(memory, "_step_peak", lambda model, **kw: stepped.append(len(alike_layers(model))) or 0)
    dims = ParallelDims(dp_shard=2).resolve(2)
    activation_bytes(_on_meta(num_hidden_layers=11), dims, micro_batch=2, seq_len=64, backward_prefetch=4)
    assert stepped == [11]
    activation_bytes(_on_meta(num_hidden_layers=17), dims, micro_batch=2, seq_len=64, backward_prefetch=4)
    assert stepped[1:] == [6, 7, 8]


def test_a_figure_not_yet_linear_in_the_layers_is_not_extrapolated():
    """Where the few-layer measurements' increments differ, the whole model is measured."""
    values = {3: 30, 4: 41, 5: 50, 11: 117}  # one layer adds 11, the next 9

    def measure(model):
        return values[len(alike_layers(model))]

    assert over_layers(measure, _on_meta(num_hidden_layers=11)) == 117
    values[5] = 52  # each adds 11: extrapolated
    assert over_layers(measure, _on_meta(num_hidden_layers=11)) == 52 + 6 * 11


def test_few_layers_not_yet_linear_slide_before_the_whole_model_is_measured():
    """Of 20 layers: 3 to 4 add 11, each further layer 9: 4, 5 and 6 extrapolate (the whole never measured); a
    figure linear from no count up to 7 is measured whole."""
    values = {3: 30, 4: 41, 5: 50, 6: 59, 20: 185}
    measured = []

    def measure(model):
        measured.append(len(alike_layers(model)))
        return values[len(alike_layers(model))]

    assert over_layers(measure, _on_meta(num_hidden_layers=20)) == 59 + 14 * 9
    assert measured == [3, 4, 5, 6]
    values.update({6: 60, 7: 71, 20: 201})
    measured.clear()
    assert over_layers(measure, _on_meta(num_hidden_layers=20)) == 201
    assert measured == [3, 4, 5, 6, 7, 20]


def test_the_estimate_fills_no_host_memory_with_the_layers_it_gathers():
    """FSDP2's buffers (the gathered layers, their gradients before the reduce-scatter) are made empty, hence fake:
    estimating a layout whose gathered layers take half a GiB makes no real tensor larger than a few KiB (the mesh's
    ranks, the positions) and counts the buffers all the same."""
    model = _on_meta(vocab_size=512, hidden_size=2048, intermediate_size=8192, num_hidden_layers=2)
    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    with _RealTensorsMade() as made:
        estimate = activation_bytes(model, ParallelDims(dp_shard=8).resolve(8), micro_batch=1, seq_len=64)
    assert estimate > 2 * layer_bytes > 2**30 / 4
    assert max(made.sizes) < 2**16, sorted(made.sizes)[-3:]


@pytest.mark.parametrize(
    "dims, options",
    [
        (ParallelDims(dp_shard=4), dict(activation_checkpointing="selective")),
        (ParallelDims(pp=2, dp_shard=2), dict(pipeline=PipelineOptions(microbatches=2))),
    ],
)
def test_fake_buffers_change_no_byte_of_the_estimate(dims, options, monkeypatch):
    """The estimate with FSDP2's buffers and the stages' receive buffers fake equals the one with them real."""
    step = dict(micro_batch=2, seq_len=64, **options)
    fake = activation_bytes(_on_meta(vocab_size=8000, **MEMORY_MODEL), dims.resolve(4), **step)
    monkeypatch.setattr(memory, "_EMPTY", ())
    assert activation_bytes(_on_meta(vocab_size=8000, **MEMORY_MODEL), dims.resolve(4), **step) == fake


class _RealTensorsMade(TorchDispatchMode):
    """The bytes of every tensor holding data the ops run inside make."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes = [0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for made in pytree.tree_leaves(out):
            if type(made) in (torch.Tensor, nn.Parameter) and not made.is_meta:  # not fake, nor a DTensor wrapper
                self.sizes.append(made.untyped_storage().nbytes())
        return out


def test_attention_dropout_is_counted_as_a_gpus_fused_kernel_holds_it(monkeypatch):
    """With attention dropout, SDPA on CPU takes its math path and keeps the [heads, S, S] scores and dropout's mask; a
    GPU's flash and memory-efficient kernels keep neither (they draw the mask again in backward). The estimate counts
    the fused kernel whatever the dropout, and the report says so; without that, dropout costs scores a layer."""
    from lightning_automodel.planning.memory import attention_kernel

    model = dict(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=2)
    step = dict(micro_batch=2, seq_len=256, activation_checkpointing=False)
    fused = activation_bytes(_on_meta(**model), ParallelDims(dp_shard=1), **step)
    assert activation_bytes(_on_meta(attention_dropout=0.1, **model), ParallelDims(dp_shard=1), **step) == fused
    selective = dict(step, activation_checkpointing="selective")  # backward recomputes the attention
    assert activation_bytes(_on_meta(attention_dropout=0.1, **model), ParallelDims(dp_shard=1), **selective) == (
        activation_bytes(_on_meta(**model), ParallelDims(dp_shard=1), **selective)
    )
    report = plan_report(_on_meta(attention_dropout=0.1, **model), ParallelDims(dp_shard=1), batch_shape=(2, 256))
    assert f"attention: {attention_kernel.ASSUMED_KERNEL}" in str(report)

    monkeypatch.setattr(memory, "fused_attention", contextlib.nullcontext)
    math_path = activation_bytes(_on_meta(attention_dropout=0.1, **model), ParallelDims(dp_shard=1), **step)
    scores = 2 * 4 * 256 * 256 * 4  # rows x heads x S x S in fp32, one layer
    assert math_path - fused >= scores, (math_path, fused)
