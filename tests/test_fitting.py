"""`plan --fit`: the layouts of a world that fit a GPU, each with the checkpointing setting that recomputes least, and
the throughput model that ranks them (no processes: fake process groups and fake tensors)."""

from functools import cache, partial

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from transformers import AutoModelForCausalLM

from lightning_automodel import ParallelDims, plan_report
from lightning_automodel.parallel.activation_checkpointing import AC_MODES
from lightning_automodel.parallel.pipeline import PipelineOptions
from lightning_automodel.planning.flops import flops_per_token
from lightning_automodel.planning.memory.activations import activation_bytes
from lightning_automodel.planning.memory.layer_extrapolation import over_layers
from lightning_automodel.planning.memory.optimizer_step import optimizer_step_bytes
from lightning_automodel.planning.memory.step_options import StepOptions
from lightning_automodel.planning.search import layouts as search_layouts
from lightning_automodel.planning.search.fitting import NoLayoutFits, choose_layout, fitting_layouts
from lightning_automodel.planning.search.layouts import HEADROOM, SearchSpace, layouts
from lightning_automodel.planning.search.throughput import Hardware, tokens_per_second
from lightning_automodel.testing.models import tiny_config

ROWS, TOKENS = 2, 64


def _on_meta(**overrides):
    shape = dict(vocab_size=512, hidden_size=128, intermediate_size=256) | overrides
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(**shape))


def _layout(dims: ParallelDims) -> dict:
    return dict(sp=dims.tp > 1, pipeline=PipelineOptions(microbatches=ROWS) if dims.pp > 1 else None)


@cache
def _memory(dims: ParallelDims, setting: str) -> int:
    """The plan's state plus the larger of the activation estimate and the AdamW step's temporaries (after
    backward); under pp, of the stage where they add up to the most."""
    states = _states(dims)
    step = dict(micro_batch=ROWS, seq_len=TOKENS, activation_checkpointing=setting, **_layout(dims))
    return max(
        state
        + max(
            activation_bytes(_on_meta(), dims, rank=stage * dims.ranks_per_stage, **step),
            _temporaries(dims, stage * dims.ranks_per_stage),
        )
        for stage, state in enumerate(states)
    )


@cache
def _states(dims: ParallelDims) -> tuple[int, ...]:
    """The plan's parameters, gradients and AdamW state per rank of each stage (one without pp)."""
    report = plan_report(_on_meta(), dims, **_layout(dims))
    return tuple(stage.training_bytes_per_rank for stage in report.stages) or (report.training_bytes_per_rank,)


@cache
def _temporaries(dims: ParallelDims, rank: int) -> int:
    return optimizer_step_bytes(_on_meta(), dims, rank=rank, **_layout(dims))


def test_each_layout_takes_the_least_recomputing_setting_that_fits():
    """A budget between a layout's memory without and with full checkpointing: the layout is listed with the first
    setting (off, selective, submodule, full) whose memory fits, that memory being the plan's state plus the larger of
    the setting's activation estimate and the AdamW step's temporaries (under pp, the largest stage's); a layout the
    tiny model's 2 KV heads cannot split over tp=4 is refused with the plan's reason, pp=4 for want of rows (1F1B: a
    row per micro-batch, as many as stages): printed. pp x cp is listed with its memory (a stage receiving its rank's
    share of the rows)."""
    single = ParallelDims(dp_shard=4).resolve(4)
    off, full = _memory(single, "off"), _memory(single, "full")
    assert full < off
    budget = (off + full) / 2
    fitting = fitting_layouts(
        _on_meta(), 4, hardware=Hardware(memory_gib=budget / (1 - HEADROOM) / 2**30), batch_shape=(ROWS, TOKENS)
    )
    layouts = [*fitting.fits, *fitting.too_large]
    listed = {(layout.dims.pp, layout.dims.tp, layout.dims.cp): layout for layout in layouts}
    assert set(listed) == {(1, 1, 1), (1, 1, 2), (1, 1, 4), (1, 2, 1), (1, 2, 2), (2, 1, 1), (2, 1, 2), (2, 2, 1)}
    assert set(fitting.refused) == {"tp=4 cp=1 dp_shard=1", "pp=4 tp=1 cp=1 dp_shard=1"}
    assert listed[(1, 1, 1)] in fitting.fits and listed[(1, 1, 1)].checkpointing != "off"
    # data parallel; tp with sp; pp over data parallel; pp x cp (each estimate costs seconds)
    for layout in (listed[(1, 1, 1)], listed[(1, 2, 1)], listed[(2, 1, 1)], listed[(2, 1, 2)]):
        assert layout in fitting.fits
        assert layout.memory_bytes == _memory(layout.dims, layout.checkpointing) <= budget
        earlier = list(AC_MODES)[: AC_MODES.index(layout.checkpointing)]
        assert all(_memory(layout.dims, setting) > budget for setting in earlier), layout
    for layout in fitting.too_large:
        assert layout.checkpointing == "full" and layout.memory_bytes == _memory(layout.dims, "full") > budget
    # layout="auto"'s search picks the table's first row, measuring fewer candidates than there are.
    choice = choose_layout(_on_meta(), 4, hardware=fitting.hardware, batch_shape=(ROWS, TOKENS), space=SearchSpace())
    first = fitting.fits[0]
    assert (choice.candidate.dims, choice.candidate.checkpointing) == (first.dims, first.checkpointing)
    assert choice.outcome.memory_bytes == first.memory_bytes
    assert len(choice.record.outcomes) < len(choice.record.ranked)
    text = str(fitting)
    assert "refused: tp=4 cp=1 dp_shard=1: " in text
    assert "refused: pp=4 tp=1 cp=1 dp_shard=1: a batch of 2 rows: pp_microbatches=2 with pp=4: the 1F1B" in text
    assert "counted with SDPA's dense [rows, S/cp, S] mask" in text


def test_tensor_parallel_stays_inside_a_node():
    """tp divides a node's GPUs: on nodes of 8, a world of 12 is split with tp 1, 2 and 4, never 3, 6 or 12."""
    assert sorted({dims.tp for dims in layouts(12, gpus_per_node=8)}) == [1, 2, 4]


class _Throughput:
    """The model's numbers worked by hand for the tiny Llama at ROWS x TOKENS, in fp32."""

    def __init__(self, hardware: Hardware):
        self.model, self.hardware = _on_meta(), hardware
        config = self.model.config
        self.layers, self.hidden = config.num_hidden_layers, config.hidden_size
        self.kv_width = config.num_key_value_heads * config.hidden_size // config.num_attention_heads
        self.weights = sum(p.numel() for p in self.model.parameters())
        flops = flops_per_token(self.model, TOKENS) * ROWS * TOKENS
        self.compute = flops / (hardware.tflops * 1e12 * hardware.matmul_efficiency)

    def speed(self, dims: ParallelDims, setting: str, **options) -> float:
        return tokens_per_second(
            self.model,
            dims.resolve(dims.pp * dims.tp * dims.cp * dims.dp_shard * dims.dp_replicate),
            batch_shape=(ROWS, TOKENS),
            setting=setting,
            hardware=self.hardware,
            **options,
        )


def test_the_throughput_model_by_hand():
    """One GPU: the step is its FLOPs at the assumed share of the peak, a third more with full checkpointing. tp=2:
    per layer and pass two all-reduces moving 2 (tp - 1) / tp of a [tokens, hidden] activation, exposed at the node's
    bandwidth; selective checkpointing runs them in a third pass, as full does."""
    model = _Throughput(Hardware(memory_gib=80))
    tokens, node = ROWS * TOKENS, model.hardware.node_gbps * 1e9
    assert model.speed(ParallelDims(dp_shard=1), "off") == pytest.approx(tokens / model.compute)
    assert model.speed(ParallelDims(dp_shard=1), "full") == pytest.approx(tokens / (model.compute * 4 / 3))
    all_reduce = 2 * (2 - 1) / 2 * tokens * model.hidden * 4
    for setting, compute, passes in [("off", 1.0, 2), ("selective", 7 / 6, 3)]:
        exposed = model.layers * 2 * passes * all_reduce / node
        expected = tokens / 2 / (model.compute * compute / 2 + exposed)
        assert model.speed(ParallelDims(tp=2, dp_shard=1), setting) == pytest.approx(expected), setting


def test_pipeline_stages_compute_their_share_in_the_schedule_slots():
    """pp=2 of one GPU each: a stage computes half the FLOPs and hands each micro-batch's hidden states on and their
    gradients back ([tokens, hidden] each way, at the node's bandwidth), in the m + p - 1 slots 1F1B takes for m
    micro-batches. With tp=2 too, a stage computes a quarter, runs the all-reduces of its one layer and hands on half
    the tokens (sp). At dp_shard=2 under bf16-mixed (bf16 gathers, fp32 reductions), FSDP2 gathers a stage's half of
    the weights once, behind its first micro-batch's forward (a third of that micro-batch's compute), and reduces their
    gradients after the last backward, exposed: with the compute made negligible, and with it made long enough to hide
    every gather, where only the reduction remains."""
    model = _Throughput(Hardware(memory_gib=80))
    tokens, node = ROWS * TOKENS, model.hardware.node_gbps * 1e9
    pipeline, slots = PipelineOptions(microbatches=ROWS), (ROWS + 2 - 1) / ROWS
    stream = 2 * tokens * model.hidden * 4 / node
    step = (model.compute / 2 + stream) * slots
    assert model.speed(ParallelDims(pp=2, dp_shard=1), "off", pipeline=pipeline) == pytest.approx(tokens / 2 / step)
    all_reduce = 2 * (2 - 1) / 2 * tokens * model.hidden * 4 / node
    step = (model.compute / 4 + model.layers / 2 * 2 * 2 * all_reduce + stream / 2) * slots
    expected = tokens / 4 / step
    assert model.speed(ParallelDims(pp=2, tp=2, dp_shard=1), "off", pipeline=pipeline) == pytest.approx(expected)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for tflops in (1e9, 1e-6):
        model = _Throughput(Hardware(memory_gib=80, tflops=tflops))
        stage = model.compute / 2
        gather, reduce_scatter = (model.weights / 2 * (2 - 1) / 2 * size / node for size in (2, 4))
        step = (stage + stream / 2) * slots + reduce_scatter + max(0.0, gather - stage / (3 * ROWS))
        speed = model.speed(ParallelDims(pp=2, dp_shard=2), "off", pipeline=pipeline, mp_policy=bf16)
        assert speed == pytest.approx(tokens / 2 / step), tflops
        assert (gather > stage / (3 * ROWS)) == (tflops == 1e9)


def test_context_parallel_traffic_and_its_fsdp_group():
    """cp=2 on one node, compute made negligible (a GPU of 1e9 TFLOP/s): the step is cp's key and value traffic
    (the other rank's half of each row's keys and values per layer, forward and backward) plus FSDP2's, which shards
    over dp_shard x cp = 2 even at dp_shard=1 (gathers twice, reduces once: 12 bytes per fp32 weight, halved)."""
    model = _Throughput(Hardware(memory_gib=80, tflops=1e9))
    node = model.hardware.node_gbps * 1e9
    gathered = 2 * model.kv_width * 4 * (2 - 1) / 2 * ROWS * TOKENS  # bytes per layer and pass
    fsdp = model.weights * (2 - 1) / 2 * (2 * 4 + 4)
    step = model.compute / 2 + model.layers * 2 * gathered / node + max(0.0, fsdp / node - model.compute / 2)
    assert model.speed(ParallelDims(cp=2, dp_shard=1), "off") == pytest.approx(ROWS * TOKENS / 2 / step)


def test_hsdp_layouts_fill_a_node_and_are_estimated_as_such():
    """On several nodes, HSDP layouts are listed: each shard group (tp x cp x dp_shard) a whole node, replicated over
    the nodes; none on one node. Their memory is the plan's state of a shard group (half the model's at dp_shard=2,
    not a quarter) plus the activation estimate, both run under HSDP's mesh."""
    hsdp = [dims for dims in layouts(16, gpus_per_node=8) if dims.dp_replicate > 1]
    assert len(hsdp) == 10  # (tp, cp) with tp x cp dividing 8
    assert all(dims.dp_replicate == 2 and dims.tp * dims.cp * dims.dp_shard == 8 for dims in hsdp)
    assert all(dims.dp_replicate == 1 for dims in layouts(8, gpus_per_node=8))
    replicated = ParallelDims(dp_shard=2, dp_replicate=2).resolve(4)
    space = SearchSpace(dp_shard=2, dp_replicate=2)
    fitting = fitting_layouts(_on_meta(), 4, hardware=Hardware(float("inf")), batch_shape=(ROWS, TOKENS), space=space)
    (fit,) = fitting.fits
    assert (fit.dims, fit.checkpointing, fit.memory_bytes) == (replicated, "off", _memory(replicated, "off"))
    state = {dims.dp_shard: plan_report(_on_meta(), dims).training_bytes_per_rank for dims in (replicated, _FSDP4)}
    assert state[2] == pytest.approx(2 * state[4], rel=0.01)


_FSDP4 = ParallelDims(dp_shard=4).resolve(4)


def test_hsdp_traffic_between_nodes_is_the_replicas_all_reduce():
    """Two nodes of 8, compute made negligible: FSDP2 over all 16 ranks moves 12 bytes per fp32 weight (two
    gathers, one reduction) x 15/16 over the network; HSDP moves 12 x 7/8 within the node and, across nodes, only
    the all-reduce of each rank's eighth of the gradient between its 2 replicas (2 x 1/2 x 4 bytes)."""
    model = _Throughput(Hardware(memory_gib=80, tflops=1e9))
    node, network = model.hardware.node_gbps * 1e9, model.hardware.network_gbps * 1e9
    tokens = ROWS * TOKENS
    everywhere = model.weights * 15 / 16 * 12 / network
    assert model.speed(ParallelDims(dp_shard=16), "off") == pytest.approx(tokens / (model.compute + everywhere))
    within = model.weights * 7 / 8 * 12 / node
    across = model.weights / 8 * 2 * (2 - 1) / 2 * 4 / network
    expected = tokens / (model.compute + within + across)
    assert model.speed(ParallelDims(dp_shard=8, dp_replicate=2), "off") == pytest.approx(expected)
    assert expected > tokens / (model.compute + everywhere)


def test_the_state_of_many_alike_layers_is_extrapolated_exactly():
    """The plan's parameters, gradients and AdamW state per rank, like the activations, from three to five layers."""

    def model():
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(tiny_config(hidden_size=128, num_hidden_layers=11))

    dims = ParallelDims(tp=2, dp_shard=2).resolve(4)
    measured = []

    def state(copied):
        measured.append(len(copied.model.layers))
        return plan_report(copied, dims, sp=True).training_bytes_per_rank

    assert over_layers(state, model()) == state(model())
    assert measured == [3, 4, 5, 11]


def test_a_layout_the_optimizers_temporaries_overflow_is_not_chosen(monkeypatch):
    """Eight tokens a batch at tp=2: the foreach AdamW step's temporaries (1.9 MiB) exceed the step's activations
    (1.4 MiB). With a budget between the state plus either, the layout fits only if the temporaries are left out, as
    they were before: the search then chose it. Counted, nothing fits, and the refusal names them; with fused AdamW,
    which allocates none, it is chosen."""
    dims, batch = ParallelDims(tp=2).resolve(2), (1, 8)
    _deeper = partial(_on_meta, num_hidden_layers=6)
    state = plan_report(_deeper(), dims, sp=True).training_bytes_per_rank
    activations = activation_bytes(_deeper(), dims, micro_batch=1, seq_len=8, sp=True, activation_checkpointing="off")
    temporaries = optimizer_step_bytes(_deeper(), dims, sp=True)
    assert temporaries > activations
    hardware = Hardware(memory_gib=(state + (activations + temporaries) / 2) / (1 - HEADROOM) / 2**30)
    search = dict(hardware=hardware, batch_shape=batch, space=SearchSpace(tp=2))
    with pytest.raises(NoLayoutFits, match="the AdamW step's temporaries"):
        choose_layout(_deeper(), 2, **search)
    fused = choose_layout(_deeper(), 2, step=StepOptions(adamw="fused"), **search)
    assert (fused.candidate.checkpointing, fused.outcome.optimizer_bytes) == ("off", 0)
    assert fused.outcome.memory_bytes == state + activations
    assert "temporaries of the AdamW step (fused) after backward" in str(fused)
    monkeypatch.setattr(search_layouts, "optimizer_step_bytes", lambda *args, **kwargs: 0)
    left_out = choose_layout(_deeper(), 2, **search)
    assert left_out.candidate.dims == dims and state + temporaries > left_out.record.budget
