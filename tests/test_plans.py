"""Plan selection and validation: pure functions, no process group needed."""

import pytest
import torch
from models import tiny_config, tiny_model
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from lightning_automodel.parallel import (
    DefaultParallelizationStrategy,
    ParallelizationStrategy,
    decoder_layers,
    parallelize,
    register_parallelization_strategy,
)
from lightning_automodel.parallel.hf_plan import hf_style_strings, translate_style
from lightning_automodel.parallel.parallelizer import (
    apply_tensor_parallel,
    check_plan_coverage,
    is_meta,
    parallelization_strategy_for,
)
from lightning_automodel.parallel.plans import select_tp_plan, unmatched_patterns, unsharded_linears
from lightning_automodel.parallel.styles import HeadShardedNorm, PackedColwiseParallel, RegroupedColwiseParallel
from lightning_automodel.parallel.validation import validate_tp_sizes

USER_PLAN = {"model.layers.*.mlp.up_proj": ColwiseParallel(), "model.layers.*.mlp.down_proj": RowwiseParallel()}


def user_plan_function(model, sp):
    return {**USER_PLAN, "sp": sp}


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_registered_family_plan(family):
    plan, source = select_tp_plan(tiny_model(family), sp=True)
    assert source == f"family plan for {type(tiny_model(family)).__name__}"
    assert unmatched_patterns(tiny_model(family), plan) == []


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
    plan, source = select_tp_plan(tiny_model(), sp=False, tp_plan=spec)
    assert (plan, source) == (expected, "user plan")


def test_unregistered_model_uses_its_hugging_face_plan():
    plan, source = select_tp_plan(tiny_model("granite"), sp=False)
    assert source == "Hugging Face plan of GraniteForCausalLM"
    assert isinstance(plan["model.layers.*.mlp.down_proj"], RowwiseParallel)
    assert plan["lm_head"].output_layouts == (Shard(-1),), "lm_head must leave the logits vocab-sharded"
    assert unmatched_patterns(tiny_model("granite"), plan) == []


def test_hugging_face_plans_have_no_sequence_parallel_layout():
    with pytest.raises(ValueError, match="sp=True: GraniteForCausalLM has no registered plan"):
        select_tp_plan(tiny_model("granite"), sp=True)


def test_a_model_without_any_plan_gets_the_default_plan():
    class PlanlessLlama(type(tiny_model())):
        _tp_plan = None

    config = tiny_config()
    config.base_model_tp_plan = None
    model = PlanlessLlama(config)
    model._tp_plan = None
    model.model._tp_plan = None
    plan, source = select_tp_plan(model, sp=False)
    assert source == "default Llama-style plan" and "lm_head" in plan


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
        apply_tensor_parallel(tiny_model(), mesh=None, sp=False, tp_plan={"decoder.*.fc1": ColwiseParallel()})


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


def test_a_half_meta_model_is_refused():
    model = tiny_model()
    model.lm_head.to("meta")
    with pytest.raises(ValueError, match="both on the meta device and real ones"):
        is_meta(model)
    with torch.device("meta"):
        assert is_meta(tiny_model())


def test_every_hugging_face_style_string_is_understood():
    """Each style of the installed transformers is translated, or refused as needing transformers' runtime."""
    import transformers.distributed.expert_parallel  # noqa: F401  (registers the expert-parallel styles)
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    names = set(ALL_PARALLEL_STYLES) | {"colwise_rep", "rowwise_rep", "sequence_parallel", "local_colwise", "local"}
    for name in sorted(names):
        try:
            translate_style(name, "model.layers.*.mlp")
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
        ("replicated_with_grad_allreduce", HeadShardedNorm),
        ("packed_colwise", PackedColwiseParallel),
    ],
)
def test_style_translations(style, expected):
    assert isinstance(translate_style(style, "x"), expected)


def test_replicated_gather_styles_gather():
    assert translate_style("colwise_gather_output", "x").output_layouts == (Replicate(),)
    assert translate_style("rowwise_split_input", "x").input_layouts == (Replicate(),)


def test_an_unknown_style_names_itself_and_its_module():
    with pytest.raises(ValueError, match="Unknown Hugging Face tensor-parallel style 'diagonal' for module 'model.x'"):
        translate_style("diagonal", "model.x")


def test_a_plan_that_leaves_the_mlp_whole_is_refused_unless_allowed():
    attention_only = {f"model.layers.*.self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
    model = tiny_model()
    with pytest.raises(ValueError, match="leaves large Linear layers of the blocks it shards unsharded") as error:
        check_plan_coverage(model, attention_only, source="user plan")
    assert "model.layers.0.mlp.gate_proj" in str(error.value) and "allow_unsharded_linears=True" in str(error.value)
    check_plan_coverage(model, attention_only, source="user plan", allow_unsharded_linears=True)


def test_the_vision_tower_of_a_multimodal_model_is_not_flagged():
    model = tiny_model("gemma3_vlm")
    plan, source = select_tp_plan(model, sp=False)
    assert unsharded_linears(model, plan) == []


def test_a_registered_parallelization_strategy_takes_over_the_flow():
    calls = []

    class Family(torch.nn.Module):
        pass

    @register_parallelization_strategy("Family")
    class FamilyStrategy(ParallelizationStrategy):
        def parallelize(self, model, device_mesh, **options):
            calls.append((model, device_mesh, options))
            return model

    model = Family()
    assert isinstance(parallelization_strategy_for(model), FamilyStrategy)
    assert parallelize(model, "mesh", sp=True) is model
    assert calls == [(model, "mesh", {"sp": True})]
    assert isinstance(parallelization_strategy_for(tiny_model()), DefaultParallelizationStrategy)


def test_user_plans_may_use_hugging_face_style_strings():
    plan, _ = select_tp_plan(
        tiny_model(), sp=False, tp_plan={"a.b": "colwise", "c.d": "rowwise_split_input", "e": "replicate"}
    )
    assert isinstance(plan["a.b"], ColwiseParallel) and plan["c.d"].input_layouts == (Replicate(),)
    assert "e" not in plan
    with pytest.raises(ValueError, match="Unknown Hugging Face tensor-parallel style 'sideways' for module 'a.b'"):
        select_tp_plan(tiny_model(), sp=False, tp_plan={"a.b": "sideways"})


def test_phi3_fused_projections_are_split_block_by_block():
    equal, _ = select_tp_plan(tiny_model("phi3"), sp=False)
    grouped, _ = select_tp_plan(tiny_model("phi3_gqa"), sp=False)
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


def test_activation_checkpointing_modes_are_checked():
    from lightning_automodel.parallel.checkpointing import apply_activation_checkpointing

    model = tiny_model()
    with pytest.raises(ValueError, match='activation_checkpointing=\'partial\': use False, True/"full", "selective"'):
        apply_activation_checkpointing(model, decoder_layers(model), mode="partial")
    with pytest.raises(ValueError, match='"submodule" found no attention or MLP block in Linear'):
        apply_activation_checkpointing(model, [torch.nn.Linear(2, 2)], mode="submodule")
