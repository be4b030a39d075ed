"""`plan --fit`: the layouts of a world that fit a GPU, each with the checkpointing mode that recomputes least, and the
throughput model that ranks them (no processes: fake process groups and fake tensors)."""

import pytest
import torch
from models import tiny_config
from transformers import AutoModelForCausalLM

from lightning_automodel import ParallelDims, plan_report
from lightning_automodel.fitting import CHECKPOINTING, HEADROOM, Hardware, _tokens_per_second, fitting_layouts
from lightning_automodel.lm.flops import flops_per_token
from lightning_automodel.parallel.memory import activation_bytes

ROWS, TOKENS = 2, 128


def _on_meta():
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(vocab_size=512, hidden_size=128, intermediate_size=256))


def _memory(dims: ParallelDims, mode: str) -> int:
    state = plan_report(_on_meta(), dims, sp=dims.tp > 1).training_bytes_per_rank
    argument = CHECKPOINTING[mode].argument
    extra = activation_bytes(
        _on_meta(), dims, micro_batch=ROWS, seq_len=TOKENS, sp=dims.tp > 1, activation_checkpointing=argument
    )
    return state + extra


def test_each_layout_takes_the_least_recomputing_mode_that_fits():
    """A budget between a layout's no-checkpointing and full-checkpointing memory: the layout is listed with the first
    mode (off, selective, submodule, full) whose memory fits, and that memory is the plan's state plus the activation
    estimate of the mode; a layout the tiny model's 2 KV heads cannot split over tp=4 is refused with the plan's
    reason; the listed layouts come best estimated throughput first."""
    single = ParallelDims(dp_shard=4).resolve(4)
    off, full = _memory(single, "off"), _memory(single, "full")
    assert full < off
    budget = (off + full) / 2
    fitting = fitting_layouts(
        _on_meta(), 4, hardware=Hardware(memory_gib=budget / (1 - HEADROOM) / 2**30), batch_shape=(ROWS, TOKENS)
    )
    listed = {(layout.dims.tp, layout.dims.cp): layout for layout in [*fitting.fits, *fitting.too_large]}
    assert set(listed) == {(1, 1), (1, 2), (1, 4), (2, 1), (2, 2)}
    assert list(fitting.refused) == ["tp=4 cp=1 dp_shard=1"]
    data_parallel = listed[(1, 1)]
    assert data_parallel in fitting.fits and data_parallel.checkpointing != "off"
    for layout in fitting.fits:
        assert layout.memory_bytes == _memory(layout.dims, layout.checkpointing) <= budget
        earlier = list(CHECKPOINTING)[: list(CHECKPOINTING).index(layout.checkpointing)]
        assert all(_memory(layout.dims, mode) > budget for mode in earlier), layout
    speeds = [layout.tokens_per_second for layout in fitting.fits]
    assert speeds == sorted(speeds, reverse=True)
    text = str(fitting)
    assert "best estimated throughput first" in text and "refused: tp=4 cp=1 dp_shard=1" in text


def test_the_throughput_model_by_hand():
    """One GPU: the step is its FLOPs at the assumed share of the peak. tp=2 adds its collectives, exposed: per layer
    and pass two all-reduces moving 2 (tp - 1) / tp of a [tokens, hidden] activation each; full checkpointing adds a
    third of the FLOPs and a third pass."""
    model, hardware = _on_meta(), Hardware(memory_gib=80)
    config = model.config
    flops = flops_per_token(model, TOKENS) * ROWS * TOKENS
    compute = flops / (hardware.tflops * 1e12 * hardware.matmul_efficiency)

    def speed(dims, mode):
        return _tokens_per_second(
            model,
            dims.resolve(dims.tp),
            batch_shape=(ROWS, TOKENS),
            mode=CHECKPOINTING[mode],
            gathered_per_token=0,
            hardware=hardware,
            mp_policy=None,
        )

    assert speed(ParallelDims(dp_shard=1), "off") == pytest.approx(ROWS * TOKENS / compute)
    assert speed(ParallelDims(dp_shard=1), "full") == pytest.approx(ROWS * TOKENS / (compute * 4 / 3))
    all_reduce = 2 * (2 - 1) / 2 * ROWS * TOKENS * config.hidden_size * 4
    exposed = config.num_hidden_layers * 2 * 2 * all_reduce / (hardware.node_gbps * 1e9)
    assert speed(ParallelDims(tp=2), "off") == pytest.approx(ROWS * TOKENS / 2 / (compute / 2 + exposed))
