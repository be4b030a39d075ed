"""Plan selection and validation: pure functions, no process group needed."""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from lightning_automodel.hf.decoder_layers import named_language_layers
from lightning_automodel.parallel.initial_weights import is_meta
from lightning_automodel.parallel.preflight import (
    check_rotary_parameters,
    probe_unsharded,
)
from lightning_automodel.parallel.tensor.plans.hf_plan import hf_style_strings, translate_style
from lightning_automodel.parallel.tensor.plans.selection import select_tp_plan
from lightning_automodel.parallel.tensor.plans.sharded_weights import unmatched_patterns
from lightning_automodel.parallel.tensor.sizes import validate_tp_sizes
from lightning_automodel.parallel.tensor.styles.projections import PackedColwiseParallel, RegroupedColwiseParallel
from lightning_automodel.parallel.tensor.styles.stream import SequenceParallelAllGather
from lightning_automodel.testing.coverage_report.model_types import coverage_model
from lightning_automodel.testing.models import tiny_config, tiny_model

USER_PLAN = {"model.layers.*.mlp.up_proj": ColwiseParallel(), "model.layers.*.mlp.down_proj": RowwiseParallel()}


def user_plan_function(model, sp):
    return {**USER_PLAN, "sp": sp}


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_registered_family_plan(family):
    choice = select_tp_plan(tiny_model(family), sp=True)
    assert choice.source == f"family plan for {type(tiny_model(family)).__name__}"
    assert choice.reason == "it shards every decoder block"
    assert choice.unmatched == [] and choice.unsharded_weights == []


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (USER_PLAN, USER_PLAN),
        ("test_plans.USER_PLAN", USER_PLAN),
        ("test_plans.user_plan_function", {**USER_PLAN, "sp": False}),
        (user_plan_function, {**USER_PLAN, "sp": False}),
    ],
)
def test_user_plan_wins(spec, expected):
    choice = select_tp_plan(tiny_model(), sp=False, tp_plan=spec, allow_unsharded_linears=True)
    assert (choice.plan, choice.source) == (expected, "user plan")


def test_unregistered_model_uses_its_hugging_face_plan():
    choice = select_tp_plan(tiny_model("granite"), sp=False)
    plan = choice.plan
    assert choice.source == "Hugging Face plan of GraniteForCausalLM"
    assert isinstance(plan["model.layers.*.mlp.down_proj"], RowwiseParallel)
    assert plan["lm_head"].output_layouts == (Shard(-1),), "lm_head must leave the logits vocab-sharded"
    assert unmatched_patterns(tiny_model("granite"), plan) == []


def test_with_sp_a_hugging_face_plan_gets_a_sequence_parallel_layout():
    """Hugging Face plans carry no sequence-parallel layout; one is derived with the probe's help. The stream is split
    where the blocks begin and gathered where they end; inside, the row-parallel projections reduce-scatter into it
    and the norms that open a block gather once for its projections. Outside, everything stays as without sp."""
    model = tiny_model("granite")
    choice = select_tp_plan(model, sp=True, trace=probe_unsharded(model, tp=2))
    plan = choice.plan
    assert choice.source == "Hugging Face plan of GraniteForCausalLM"
    assert plan["model.layers.*.self_attn.o_proj"].output_layouts == (Shard(1),)
    assert plan["model.layers.*.mlp.down_proj"].output_layouts == (Shard(1),)
    assert type(plan["model.layers.*.input_layernorm"]) is SequenceParallelAllGather
    assert type(plan["model.layers.*.post_attention_layernorm"]) is SequenceParallelAllGather
    first, last = plan["model.layers.0"], plan[f"model.layers.{len(model.model.layers) - 1}"]
    assert (first.begins_at, first.ends, last.begins_at, last.ends) == (0, False, None, True)
    assert plan["model.embed_tokens"].output_layouts == (Replicate(),) and "model.norm" not in plan
    assert plan["lm_head"].input_layouts == (Replicate(),)
    assert plan["lm_head"].output_layouts == (Shard(-1),), "the logits stay vocab-sharded"
    # Without a probe the norms are unknown: the default plan, whose layout is written out, stands in.
    without_probe = select_tp_plan(model, sp=True)
    assert without_probe.source == "default Llama-style plan"
    assert "sp=True: deriving a sequence-parallel layout needs a probe step of the model" in without_probe.reason


def test_the_derived_sequence_parallel_layout_follows_the_data():
    """OLMo 2 norms q and k over all heads (the hidden size, as the stream's norms) after q_proj/k_proj: not stream
    norms. Its own norms close the attention and MLP before the residual add (post-norms): they act on the stream
    and stay sharded. GPT-NeoX's parallel blocks read two norms of one stream, and its final norm sits outside them."""
    olmo2 = coverage_model("olmo2")
    plan = select_tp_plan(olmo2, sp=True, trace=probe_unsharded(olmo2, tp=2)).plan
    assert not any("q_norm" in key or "k_norm" in key for key in plan)
    assert type(plan["model.layers.*.post_attention_layernorm"]) is SequenceParallel
    assert type(plan["model.layers.*.post_feedforward_layernorm"]) is SequenceParallel
    neox = coverage_model("gpt_neox")
    plan = select_tp_plan(neox, sp=True, trace=probe_unsharded(neox, tp=2)).plan
    assert type(plan["gpt_neox.layers.*.input_layernorm"]) is SequenceParallelAllGather
    assert type(plan["gpt_neox.layers.*.post_attention_layernorm"]) is SequenceParallelAllGather
    assert "gpt_neox.final_layer_norm" not in plan  # outside the blocks: whole


def test_a_plan_covering_lm_head_only_loses_to_one_that_shards_the_blocks():
    """HunYuan's Hugging Face plan names lm_head only; the default plan shards every block, so it wins."""
    model = coverage_model("hunyuan_v1_dense")
    choice = select_tp_plan(model, sp=False)
    assert choice.source == "default Llama-style plan", choice
    assert "the Hugging Face plan of HunYuanDenseV1ForCausalLM leaves model.layers.0.self_attn.q_proj" in choice.reason
    assert choice.unsharded_weights == []


def test_no_plan_that_leaves_the_blocks_whole_is_accepted():
    """RWKV's time mixing takes its key projection's output apart in ways no plan classifies: refused with what each
    candidate lacks and the fix."""
    with pytest.raises(ValueError) as error:
        select_tp_plan(coverage_model("rwkv"), sp=False)
    message = str(error.value)
    for fragment in (
        "No tensor-parallel plan shards every decoder block of RwkvForCausalLM",
        "the derived plan (entries column-, exits row-parallel) for RwkvForCausalLM cannot be used: the output of"
        " rwkv.blocks.0.attention.key is taken apart in a way a derived plan cannot classify",
        "no family plan is registered for RwkvForCausalLM",
        "allow_unsharded_linears=True",
    ):
        assert fragment in message, message


def test_a_style_given_a_module_it_cannot_shard_makes_its_plan_unusable():
    """RoBERTa's lm_head is a head of three modules, not a Linear: named, before torch fails halfway."""
    with pytest.raises(ValueError) as error:
        select_tp_plan(coverage_model("roberta"), sp=False, tp_plan={"lm_head": ColwiseParallel()})
    assert (
        "ColwiseParallel shards nn.Linear and nn.Embedding only, and this module is a RobertaLMHead (lm_head)"
        in str(error.value)
    )


def test_a_model_without_any_plan_gets_the_default_plan():
    class PlanlessLlama(type(tiny_model())):
        _tp_plan = None

    config = tiny_config()
    config.base_model_tp_plan = None
    model = PlanlessLlama(config)
    model._tp_plan = None
    model.model._tp_plan = None
    choice = select_tp_plan(model, sp=False)
    assert choice.source == "default Llama-style plan" and "lm_head" in choice.plan


@pytest.mark.parametrize(
    ("spec", "error", "fragment"),
    [
        ("no_dots", ValueError, "is not an import path"),
        ("test_plans.missing", ValueError, "could not be imported"),
        (42, TypeError, "tp_plan must be a dict"),
    ],
)
def test_bad_user_plans_are_explained(spec, error, fragment):
    with pytest.raises(error, match=fragment):
        select_tp_plan(tiny_model(), sp=False, tp_plan=spec)


def test_a_plan_that_matches_nothing_is_an_error():
    with pytest.raises(ValueError, match="matches no module of LlamaForCausalLM"):
        select_tp_plan(tiny_model(), sp=False, tp_plan={"decoder.*.fc1": ColwiseParallel()})


def test_unmatched_patterns_are_reported():
    plan = {**USER_PLAN, "model.layers.*.mlp.fc1": ColwiseParallel()}
    assert unmatched_patterns(tiny_model(), plan) == ["model.layers.*.mlp.fc1"]


@pytest.mark.parametrize(
    ("tp", "fragments"),
    [
        (
            4,
            ["tp=4 does not divide num_key_value_heads=2", "values that divide every split size of this model: [1, 2]"],
        ),
        (3, ["num_attention_heads=4", "num_key_value_heads=2", "intermediate_size=128", "vocab_size=128"]),
    ],
)
def test_sizes_tp_cannot_split_are_named(tp, fragments):
    with pytest.raises(ValueError) as error:
        validate_tp_sizes(tiny_model(), tp)
    for fragment in fragments:
        assert fragment in str(error.value)


def test_sizes_tp_can_split_pass():
    validate_tp_sizes(tiny_model(), 2)


def test_a_rotary_embedding_that_trains_is_refused_at_tp():
    """Mistral Large 4's LeRoPE trains ``alpha`` in its rotary embedding, whose cos and sin every layer's attention
    reads: no style sums that gradient over tp (the coverage check found it wrong by 100% at tp=2). Frozen, it
    passes."""
    model = tiny_model()
    model.model.rotary_emb.alpha = torch.nn.Parameter(torch.zeros(8))
    with pytest.raises(ValueError, match=r"trains \['model.rotary_emb.alpha'\].*Freeze them"):
        check_rotary_parameters(model, tp=2)
    model.model.rotary_emb.alpha.requires_grad_(False)
    check_rotary_parameters(model, tp=2)


def test_a_half_meta_model_is_refused():
    model = tiny_model()
    model.lm_head.to("meta")
    with pytest.raises(ValueError, match="both on the meta device and real ones"):
        is_meta(model)
    with torch.device("meta"):
        assert is_meta(tiny_model())


def test_tensors_torch_makes_real_under_the_meta_device_join_the_rest():
    """torch.normal(mean, std, size) with float arguments ignores the default device: DiffLlama built on the meta
    device holds real lambda vectors. They move to meta, and its init gives them their values."""
    with torch.device("meta"):
        model = coverage_model("diffllama")
    assert not model.model.layers[0].self_attn.lambda_q1.is_meta
    assert is_meta(model)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    with torch.device("meta"):
        model = tiny_model()
    model.lm_head.weight = torch.nn.Parameter(torch.zeros(model.lm_head.weight.shape))  # a matrix a user loaded
    with pytest.raises(ValueError, match=r"\(lm_head\.weight are real\)"):
        is_meta(model)


def test_every_hugging_face_style_string_is_understood():
    """Each style of the installed transformers is translated, or refused as needing transformers' runtime."""
    import transformers.distributed.expert_parallel  # noqa: F401  (registers the expert-parallel styles)
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    names = set(ALL_PARALLEL_STYLES) | {"colwise_rep", "rowwise_rep", "sequence_parallel", "local_colwise", "local"}
    with torch.device("meta"):
        latent_attention = coverage_model("deepseek_v3")  # its config gives the rotary key's width
    for name in sorted(names):
        try:
            translate_style(name, "model.layers.*.mlp", model=latent_attention)
        except ValueError as error:
            assert "needs transformers' own runtime" in str(error), (name, error)
            assert "'model.layers.*.mlp'" in str(error)


@pytest.mark.parametrize(
    ("style", "expected"),
    [
        ("colwise", ColwiseParallel),
        ("rowwise", RowwiseParallel),
        ("colwise_gather_output", ColwiseParallel),
        ("rowwise_split_input", RowwiseParallel),
        ("embedding_rowwise", RowwiseParallel),
        ("sequence_parallel", SequenceParallel),
        ("packed_colwise", PackedColwiseParallel),
    ],
)
def test_style_translations(style, expected):
    assert isinstance(translate_style(style, "x"), expected)


def test_per_head_norm_styles_are_left_to_the_probe():
    """Hugging Face's 'replicated_with_grad_allreduce' marks q/k norms on sharded heads: nothing to shard, and the
    probe finds every such module, under any name (parallel/tensor/sharded_activations.py)."""
    assert translate_style("replicated_with_grad_allreduce", "x") is None


def test_replicated_gather_styles_gather():
    assert translate_style("colwise_gather_output", "x").output_layouts == (Replicate(),)
    assert translate_style("rowwise_split_input", "x").input_layouts == (Replicate(),)


def test_an_unknown_style_names_itself_and_its_module():
    with pytest.raises(ValueError, match="Unknown Hugging Face tensor-parallel style 'diagonal' for module 'model.x'"):
        translate_style("diagonal", "model.x")


def test_a_plan_that_leaves_the_mlp_whole_is_refused_unless_allowed():
    attention_only = {f"model.layers.*.self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
    model = tiny_model()
    with pytest.raises(
        ValueError, match="leaves large weights of LlamaForCausalLM's decoder blocks unsharded"
    ) as error:
        select_tp_plan(model, sp=False, tp_plan=attention_only)
    assert "model.layers.0.mlp.gate_proj" in str(error.value) and "allow_unsharded_linears=True" in str(error.value)
    choice = select_tp_plan(model, sp=False, tp_plan=attention_only, allow_unsharded_linears=True)
    assert "model.layers.1.self_attn.o_proj" in choice.unsharded_weights


def test_the_vision_tower_of_a_multimodal_model_is_not_flagged():
    """The blocks the language model's plan must shard are its own; the probe's step with images runs the tower's
    too, which get a plan of their own (``plans/tower.py``)."""
    with torch.device("meta"):
        model = tiny_model("gemma3_vlm")
    trace = probe_unsharded(model, tp=2)
    assert trace.images and trace.called("model.vision_tower.encoder.layers.0")
    blocks = [(name, block) for name, block in named_language_layers(model) if trace.called(name)]
    assert [name for name, _ in blocks] == ["model.language_model.layers.0", "model.language_model.layers.1"]
    choice = select_tp_plan(model, sp=False, blocks=blocks)
    assert choice.source == "family plan for Gemma3ForConditionalGeneration" and choice.unsharded_weights == []


def test_user_plans_may_use_hugging_face_style_strings():
    plan = select_tp_plan(
        tiny_model(),
        sp=False,
        tp_plan={"a.b": "colwise", "model.embed_tokens": "rowwise_split_input", "e": "replicate"},
        allow_unsharded_linears=True,
    ).plan
    assert isinstance(plan["a.b"], ColwiseParallel) and plan["model.embed_tokens"].input_layouts == (Replicate(),)
    assert "e" not in plan
    with pytest.raises(ValueError, match="Unknown Hugging Face tensor-parallel style 'sideways' for module 'a.b'"):
        select_tp_plan(tiny_model(), sp=False, tp_plan={"a.b": "sideways"})


def test_phi3_fused_projections_are_split_block_by_block():
    equal = select_tp_plan(tiny_model("phi3"), sp=False).plan
    grouped = select_tp_plan(tiny_model("phi3_gqa"), sp=False).plan
    qkv, gate_up = "model.layers.*.self_attn.qkv_proj", "model.layers.*.mlp.gate_up_proj"
    assert equal[qkv].parts == 3 and equal[gate_up].parts == 2
    assert isinstance(grouped[qkv], RegroupedColwiseParallel) and grouped[qkv].block_sizes == (64, 32, 32)


def test_hugging_face_plans_of_nested_language_models_get_their_prefix():
    strings = hf_style_strings(tiny_model("gemma3_vlm"))
    assert strings["model.language_model.layers.*.self_attn.q_proj"] == "colwise"
    assert strings["lm_head"] == "colwise_gather_output"


def test_hugging_face_plans_are_found_in_configs_when_instances_carry_none():
    """transformers 4.4x keeps base_model_tp_plan on the config and does not merge it into the instance."""
    model = tiny_model("granite")
    for module in model.modules():
        if hasattr(module, "_tp_plan"):
            module._tp_plan = None
    strings = hf_style_strings(model)
    assert strings["model.layers.*.mlp.down_proj"] == "rowwise"
    assert strings["lm_head"] == "colwise_gather_output"  # the class plan
