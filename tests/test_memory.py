"""The activation estimate (parallel/memory.py) against the peak a real training step reaches on CPU, per rank, for
each activation-checkpointing mode, tensor and sequence parallel, FSDP2, context parallel and a bf16 mixed-precision
policy; and the plan report's lines built on it."""

from functools import partial

import pytest
import torch
from harness import run_checks
from memory_checks import MEMORY_MODEL, measured_activation_bytes
from models import tiny_config
from torch.distributed.fsdp import MixedPrecisionPolicy
from transformers import AutoModelForCausalLM

from lightning_automodel import ParallelDims, plan_report
from lightning_automodel.parallel import memory
from lightning_automodel.parallel.layer_extrapolation import alike_layers, over_layers
from lightning_automodel.parallel.memory import activation_bytes

ROWS, TOKENS = 4, 256
BF16_MIXED = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# The issue asks for 15%; the estimate runs the step's own code, and lands within 0.2% of every measured peak.
TOLERANCE = 0.02
LAYOUTS = [
    (ParallelDims(dp_shard=2), dict(activation_checkpointing=False)),
    (ParallelDims(tp=2), dict(sp=True, loss_chunks=4)),  # lm_head and the loss a quarter of the sequence at a time
    (ParallelDims(tp=2), dict(activation_checkpointing="full")),
    (ParallelDims(cp=2), dict(activation_checkpointing=False)),
    (ParallelDims(dp_shard=2), dict(activation_checkpointing="selective", mp_policy=BF16_MIXED)),
]
SWEEP_LAYOUTS = [
    (ParallelDims(dp_shard=2), dict(activation_checkpointing="selective")),
    (ParallelDims(dp_shard=2), dict(activation_checkpointing="submodule")),
    (ParallelDims(dp_shard=2), dict(activation_checkpointing="full")),
    (ParallelDims(tp=2), dict(sp=True)),
]


def _on_meta(family: str = "llama", **overrides):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(family, **overrides))


def test_estimate_matches_the_measured_peak_of_every_layout():
    _assert_estimates_match_measured_peaks(LAYOUTS)


@pytest.mark.sweep
def test_estimate_matches_the_measured_peak_of_more_layouts():
    _assert_estimates_match_measured_peaks(SWEEP_LAYOUTS)


def _assert_estimates_match_measured_peaks(layouts) -> None:
    checks = [partial(measured_activation_bytes, dims, ROWS, TOKENS, **options) for dims, options in layouts]
    measured = run_checks(2, checks, timeout=600)
    for (dims, options), per_rank in zip(layouts, measured.values(), strict=True):
        model = _on_meta(vocab_size=8000, **MEMORY_MODEL)
        estimate = activation_bytes(model, dims.resolve(2), micro_batch=ROWS, seq_len=TOKENS, **options)
        for rank, peak in enumerate(per_rank):
            assert estimate == pytest.approx(peak, rel=TOLERANCE), (dims, options, rank, estimate, peak)


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


def test_pp_has_no_estimate_yet():
    """The report says so; the estimate itself refuses, naming why."""
    report = plan_report(_on_meta(num_hidden_layers=4), ParallelDims(pp=2).resolve(2), batch_shape=(2, 32))
    assert report.activation_bytes == {}
    assert "not estimated under pp > 1 yet" in str(report)
    with pytest.raises(ValueError, match="pickled objects, which a fake process group cannot carry"):
        activation_bytes(_on_meta(num_hidden_layers=4), ParallelDims(pp=2).resolve(2), micro_batch=2, seq_len=32)


@pytest.mark.parametrize(
    "family, dims, options",
    [
        ("llama", ParallelDims(dp_shard=2), dict(activation_checkpointing="selective")),
        ("qwen3", ParallelDims(tp=2, dp_shard=1), dict(sp=True)),
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
