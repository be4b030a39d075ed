"""A pipeline rank's peak extrapolated over layers and micro-batches (planning.memory.pipeline_extrapolation): exact
where the step grows alike with each, and stepped whole where it does not."""

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_automodel import ParallelDims
from lightning_automodel.parallel.pipeline import PipelineOptions
from lightning_automodel.planning.memory import activations as memory
from lightning_automodel.planning.memory.activations import activation_bytes
from lightning_automodel.planning.memory.pipeline_extrapolation import (
    over_layers_and_microbatches,
    warm_up_microbatches,
)

FEW = dict(few_layers=(3, 4, 5), few_microbatches=(3, 4, 5))


def _recorded(peak):
    measured = []

    def measure(layers: int, micro: int) -> int:
        measured.append((layers, micro))
        return peak(layers, micro)

    return measure, measured


def test_a_peak_growing_alike_with_layers_and_microbatches_is_extrapolated_from_six_steps():
    measure, measured = _recorded(lambda layers, micro: 1000 + 70 * layers + 9 * micro)
    assert over_layers_and_microbatches(measure, layers=40, microbatches=16, **FEW) == 1000 + 70 * 40 + 9 * 16
    assert measured == [(3, 3), (4, 3), (5, 3), (3, 4), (3, 5), (4, 4)]


def test_layer_counts_not_yet_linear_slide_by_a_layer():
    """The 70B example's first stage at pp=2 x tp=4: 3 to 4 layers add more than each layer from 4 on; the counts
    slide to 4, 5 and 6 (the micro-batch points with them) and extrapolate exactly, without stepping every
    micro-batch."""
    peak = lambda layers, micro: 1000 + 70 * layers + 9 * micro + 5 * (layers >= 4)  # noqa: E731
    measure, measured = _recorded(peak)
    assert over_layers_and_microbatches(measure, layers=40, microbatches=16, **FEW) == peak(40, 16)
    assert measured == [(3, 3), (4, 3), (5, 3), (3, 4), (3, 5), (4, 4), (6, 3), (4, 5), (5, 4)]


@pytest.mark.parametrize(
    "peak",
    [
        lambda layers, micro: 1000 + 70 * layers + 9 * micro + layers * micro,  # a term in both
        lambda layers, micro: 1000 + 70 * layers + 9 * micro * micro,  # not linear in micro-batches
    ],
)
def test_a_peak_not_growing_alike_is_stepped_through_every_microbatch(peak):
    measure, measured = _recorded(peak)
    assert over_layers_and_microbatches(measure, layers=40, microbatches=16, **FEW) == peak(40, 16)
    assert measured[-3:] == [(3, 16), (4, 16), (5, 16)]


def test_microbatches_are_extrapolated_only_where_that_steps_less():
    """Few layers: micro-batches alone (a stage of 8 layers, 3 + 4 + 5 micro-batches of 16); 6 micro-batches: the
    six steps would take 79 layers x micro-batches, three layer counts through all six 72."""
    measure, measured = _recorded(lambda layers, micro: 70 * layers + 9 * micro)
    assert over_layers_and_microbatches(measure, layers=8, microbatches=16, **FEW) == 70 * 8 + 9 * 16
    assert measured == [(8, 3), (8, 4), (8, 5)]
    measure, measured = _recorded(lambda layers, micro: 70 * layers + 9 * micro)
    over_layers_and_microbatches(measure, layers=40, microbatches=6, **FEW)
    assert measured == [(3, 6), (4, 6), (5, 6)]


def _llama(layers: int) -> AutoModelForCausalLM:
    config = AutoConfig.for_model(
        "llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return AutoModelForCausalLM.from_config(config, torch_dtype=None).to("meta")


@pytest.mark.parametrize("rank", [0, pytest.param(1, marks=pytest.mark.sweep)])  # rank 0's warm-up is the longer
def test_a_pipeline_ranks_peak_over_many_microbatches_is_the_whole_steps(rank, monkeypatch):
    """23 layers in two stages, 1F1B over 8 micro-batches: each rank's peak, from six steps of at most five layers
    and as many micro-batches as its warm-up (where every further one adds the same) and two more, equals the step of
    its whole stage through all eight, to the byte."""
    pipeline = PipelineOptions(microbatches=8)
    step = dict(dims=ParallelDims(pp=2).resolve(2), micro_batch=16, seq_len=32, rank=rank, pipeline=pipeline)
    whole = memory._step_peak(_llama(23), **step)
    stepped, step_peak = [], memory._step_peak

    def counted(model, **kw):
        stepped.append(kw["pipeline"].microbatches)
        return step_peak(model, **kw)

    monkeypatch.setattr(memory, "_step_peak", counted)
    assert activation_bytes(_llama(23), **step) == whole
    warm = warm_up_microbatches(pipeline, pp=2, stage=rank)
    assert stepped == [warm, warm, warm, warm + 1, warm + 2, warm + 1]
