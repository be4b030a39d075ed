"""Derived plans (parallel.tensor.plans.derived): the style each module of a block gets, from following the
data through one meta-device step; no process group needed."""

import pytest
import torch
from test_plans import coverage_model
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel

from lightning_automodel import ParallelDims, plan_report
from lightning_automodel.parallel.probe.step import PROBE_TOKENS_PER_RANK, meta_copy, probe
from lightning_automodel.parallel.tensor.plans.derived import derived_plan
from lightning_automodel.parallel.tensor.plans.patterns import pattern_matches
from lightning_automodel.parallel.tensor.plans.selection import select_tp_plan
from lightning_automodel.parallel.tensor.plans.sequence_parallel import with_sequence_parallel
from lightning_automodel.parallel.tensor.styles.projections import (
    Conv1DColwiseParallel,
    Conv1DRowwiseParallel,
    OwnedOutputRowwiseParallel,
    PackedColwiseParallel,
    VocabParallelEmbedding,
)

# A derived plan's exits own their outputs: model code may add to them in place (Falcon's).
COLWISE, ROWWISE = ColwiseParallel, OwnedOutputRowwiseParallel

# Block 0 of a type of every kind the derived plan covers: module (under the block) -> the style it must get.
EXPECTED = {
    # Post-norm BERT: separate q/k/v under their own names, exits named `dense`.
    "bert": (
        "bert.encoder.layer.0",
        {
            "attention.self.query": COLWISE,
            "attention.self.key": COLWISE,
            "attention.self.value": COLWISE,
            "attention.output.dense": ROWWISE,
            "intermediate.dense": COLWISE,
            "output.dense": ROWWISE,
        },
    ),
    # BART's decoder as a causal LM: its cross-attention never runs, and gets nothing.
    "bart": (
        "model.decoder.layers.0",
        {
            "self_attn.q_proj": COLWISE,
            "self_attn.v_proj": COLWISE,
            "self_attn.out_proj": ROWWISE,
            "fc1": COLWISE,
            "fc2": ROWWISE,
            "encoder_attn.q_proj": None,
        },
    ),
    # GPT-2's Conv1D layers; c_attn's output is split into [q; k; v]: packed.
    "gpt2": (
        "transformer.h.0",
        {
            "attn.c_attn": PackedColwiseParallel,
            "attn.c_proj": Conv1DRowwiseParallel,
            "mlp.c_fc": Conv1DColwiseParallel,
            "mlp.c_proj": Conv1DRowwiseParallel,
        },
    ),
    # GPT-NeoX-Japanese's fused qkv is viewed per head, (heads, 3 * head_dim): whole heads per rank, plain colwise.
    "gpt_neox_japanese": (
        "gpt_neox_japanese.layers.0",
        {
            "attention.query_key_value": COLWISE,
            "attention.dense": ROWWISE,
            "mlp.dense_h_to_4h": COLWISE,
            "mlp.dense_4h_to_h": ROWWISE,
        },
    ),
    # Moshi's fused [gate; up] is viewed as (2, intermediate) and taken apart along the 2: packed, not heads.
    "moshi": ("model.layers.0", {"mlp.fc1": PackedColwiseParallel, "mlp.fc2": ROWWISE}),
    # GPT-J's parallel block: attention and MLP both read the same norm's output, and are summed.
    "gptj": (
        "transformer.h.0",
        {
            "attn.q_proj": COLWISE,
            "attn.k_proj": COLWISE,
            "attn.out_proj": ROWWISE,
            "mlp.fc_in": COLWISE,
            "mlp.fc_out": ROWWISE,
        },
    ),
}


@pytest.mark.parametrize("model_type", list(EXPECTED))
def test_each_module_of_a_block_gets_the_style_its_data_flow_needs(model_type):
    block, expected = EXPECTED[model_type]
    plan = derived_plan(coverage_model(model_type))
    for module, style in expected.items():
        found = style_of(plan, f"{block}.{module}")
        assert type(found) is style if style is not None else found is None, (module, found)
    packed = [style.parts for name, style in plan.items() if isinstance(style, PackedColwiseParallel)]
    assert set(packed) <= ({2} if model_type == "moshi" else {3}), packed


def test_the_derived_plan_is_chosen_where_no_other_shards_the_blocks_and_named_so():
    choice = select_tp_plan(coverage_model("xglm"), sp=False)
    assert choice.source == "derived plan (entries column-, exits row-parallel) for XGLMForCausalLM", choice
    assert "the default Llama-style plan leaves model.layers.0.self_attn.out_proj" in choice.reason
    assert choice.unsharded_weights == []


def test_with_sp_the_stream_is_split_inside_the_blocks_where_exits_reduce_scatter_into_it():
    model = coverage_model("gptj")
    plan = sequence_parallel_plan(model)
    for name in ("transformer.h.0.attn.out_proj", "transformer.h.0.mlp.fc_out"):
        style = style_of(plan, name)
        assert style.output_layouts == (Shard(1),) and not style.use_local_output, name
    assert style_of(plan, "transformer.h.0.attn.q_proj").input_layouts == (Replicate(),)  # a DTensor input gathers
    assert style_of(plan, "transformer.wte").output_layouts == (Replicate(),)  # whole outside the blocks
    last = len(model.transformer.h) - 1
    first, end = style_of(plan, "transformer.h.0"), style_of(plan, f"transformer.h.{last}")
    assert (first.begins_at, first.ends, end.begins_at, end.ends) == (0, False, None, True)
    # BERT's embedding stays whole (its lm_head shares a bias with a head); its blocks still carry the stream.
    bert = sequence_parallel_plan(coverage_model("bert"))
    assert style_of(bert, "bert.encoder.layer.0").begins_at == 0 and not any("embeddings" in name for name in bert)


def sequence_parallel_plan(model):
    return with_sequence_parallel(
        model, derived_plan(model), trace=probe(meta_copy(model), tokens=2 * PROBE_TOKENS_PER_RANK)
    )


def test_the_vocabulary_is_left_whole_where_the_lm_head_shares_a_parameter_with_a_head():
    """BERT's decoder bias is also cls.predictions.bias: sharding it would untie it."""
    plan = derived_plan(coverage_model("bert"))
    assert not any(name.startswith("cls.") or "embeddings" in name for name in plan), sorted(plan)
    gpt2 = derived_plan(coverage_model("gpt2"))
    assert type(gpt2["lm_head"]) is ColwiseParallel and type(gpt2["transformer.wte"]) is VocabParallelEmbedding


def test_the_plan_has_one_key_per_position_in_the_blocks_and_its_report_names_it():
    with torch.device("meta"):
        model = coverage_model("gpt2")
    report = plan_report(model, ParallelDims(tp=2).resolve(2), sp=True)
    assert report.plan_source == "derived plan (entries column-, exits row-parallel) for GPT2LMHeadModel", report
    assert report.styles["transformer.h.*.attn.c_attn"] == ("PackedColwiseParallel", 3), report.styles
    assert "tensor-parallel plan: derived plan (entries column-, exits row-parallel)" in str(report)


def style_of(plan, name):
    """The style ``plan`` gives module ``name`` (its keys may hold ``*``), or None."""
    return next((style for pattern, style in plan.items() if pattern_matches(pattern, name)), None)


class MixingActivation(torch.nn.Module):
    """An activation that mixes the MLP's hidden units (as softmax or a running sum over them would): each rank
    holding half of them would compute something else, with every shape right."""

    def __init__(self, mix):
        super().__init__()
        self.mix = mix

    def forward(self, hidden):
        return self.mix(hidden)


@pytest.mark.parametrize("mix", [lambda h: h.softmax(-1), lambda h: h.cumsum(-1), lambda h: h.flip(-1)])
def test_an_entry_whose_units_are_mixed_is_not_split(mix):
    """Only element-wise operations leave an entry's split output as it is: GPT-2's c_fc followed by an operation
    across its units gets no column-parallel style (the plan is refused, naming it)."""
    model = coverage_model("gpt2")
    for block in model.transformer.h:
        block.mlp.act = MixingActivation(mix)
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.mlp\.c_fc"):
        derived_plan(model)
