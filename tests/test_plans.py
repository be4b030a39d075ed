"""Plan selection and validation: pure functions, no process group needed."""

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_automodel.parallel.parallelizer import apply_tensor_parallel, is_meta
from lightning_automodel.parallel.plans import select_tp_plan, unmatched_patterns
from lightning_automodel.parallel.validation import validate_tp_sizes
from models import tiny_config, tiny_model

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
    assert (plan, source) == (expected, "user")


def test_unregistered_model_gets_the_default_plan():
    class CustomLlama(type(tiny_model())):
        pass

    plan, source = select_tp_plan(CustomLlama(tiny_config()), sp=False)
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
        (4, ["tp=4 does not divide num_key_value_heads=2", "values that divide every split size of this model: [1, 2]"]),
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
