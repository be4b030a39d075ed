"""Tensor-parallel plans inside gloo workers, against one process (see lightning_automodel.testing.parity): ties and
frozen parameters kept, what a plan alone gets wrong, the plan of any model type, user plans and refusals.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_automodel import parallelize
from lightning_automodel.parallel.mesh import data_mesh
from lightning_automodel.testing.collectives import CollectiveCount
from lightning_automodel.testing.models import tiny_model
from lightning_automodel.testing.parity import FP32_TOLERANCE, dims_for, forward_backward_errors


def check_tied_embeddings(sp: bool) -> dict[str, float]:
    """tie_word_embeddings: one Parameter after sharding, and its gradient sums both uses."""
    mesh = dims_for(dist.get_world_size(), 2).build_mesh("cpu")
    reference, model = tiny_model(tie_word_embeddings=True), tiny_model(tie_word_embeddings=True)
    assert reference.lm_head.weight is reference.model.embed_tokens.weight
    parallelize(model, mesh, sp=sp)
    assert model.lm_head.weight is model.model.embed_tokens.weight, "tensor parallel untied lm_head"
    errors = forward_backward_errors(model, reference, data_mesh(mesh))
    assert max(errors.values()) < FP32_TOLERANCE, errors
    return errors


def check_frozen_stays_frozen(sp: bool, family: str = "llama") -> dict[str, int]:
    """Styles must not flip requires_grad: frozen embeddings and norms stay frozen, trainable ones trainable."""
    mesh = dims_for(dist.get_world_size(), 2).build_mesh("cpu")
    model = tiny_model(family)
    for name, param in model.named_parameters():
        param.requires_grad_(not ("norm" in name or "embed" in name or "qkv" in name))
    expected = {name: p.requires_grad for name, p in model.named_parameters()}
    parallelize(model, mesh, sp=sp)
    actual = {name: p.requires_grad for name, p in model.named_parameters()}
    assert actual == expected, {name for name in expected if actual[name] != expected[name]}
    return {"frozen": sum(not v for v in actual.values()), "trainable": sum(actual.values())}


def check_naive_plan_is_wrong(family: str, replace: dict[str, object]) -> dict[str, float]:
    """The family plan with some styles replaced by what the reference uses: it runs, and the check says how
    wrong it is (the test asserts the errors are large, so our styles are what makes the family right)."""
    from lightning_automodel.parallel.tensor.plans.selection import select_tp_plan

    mesh = dims_for(dist.get_world_size(), 2).build_mesh("cpu")
    reference, model = tiny_model(family), tiny_model(family)
    plan = select_tp_plan(model, sp=False).plan
    plan.update(replace)
    parallelize(model, mesh, tp_plan=plan)
    return forward_backward_errors(model, reference, data_mesh(mesh))


def check_plan_alone_is_wrong(model_type: str, plan: str) -> dict[str, float]:
    """A plan applied by torch's ``parallelize_module`` alone, as the reference applies it: per-head norms and other
    modules computing on sharded activations stay plain. It runs; the test asserts how wrong it is, so that the
    probe's styles (what ``parallelize`` adds) are what makes these models right."""
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_automodel.parallel.mesh import tp_mesh
    from lightning_automodel.parallel.tensor.plans.selection import select_tp_plan

    mesh = dims_for(dist.get_world_size(), 2).build_mesh("cpu")
    reference, model = any_model(model_type), any_model(model_type)
    styles = LLAMA_NAMES_PLAN if plan == "llama names" else select_tp_plan(model, sp=False).plan
    parallelize_module(model, tp_mesh(mesh), styles)
    return forward_backward_errors(model, reference, data_mesh(mesh), placed=False)


def check_plan_of_any_model(model_type: str, plan: str, sp: bool = False) -> dict[str, float]:
    """fp32 parity of a model type of the coverage report (tiny config: lightning_automodel.hf.shrink) at tp=2 with
    ``plan``: "chosen" (what parallelize picks) or "llama names" (a user plan naming the Llama projections only)."""
    mesh = dims_for(dist.get_world_size(), 2).build_mesh("cpu")
    reference, model = any_model(model_type), any_model(model_type, seed=dist.get_rank())
    parallelize(model, mesh, sp=sp, tp_plan=LLAMA_NAMES_PLAN if plan == "llama names" else None)
    errors = forward_backward_errors(model, reference, data_mesh(mesh))
    assert max(errors.values()) < FP32_TOLERANCE, errors
    return errors


def any_model(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A model of any type of the coverage report, from its tiny config, with the sdpa attention the tests use."""
    from transformers import AutoModelForCausalLM

    from lightning_automodel.hf.shrink import tiny_config as coverage_config

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(coverage_config(model_type), attn_implementation="sdpa")


def check_refusal_before_any_collective() -> dict[str, int]:
    """A model with real weights and a plan that leaves its MLPs whole: refused on every rank before any collective
    (the broadcast that makes real weights identical comes after every check)."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    mesh = dims_for(dist.get_world_size(), 2).build_mesh("cpu")
    model = tiny_model(seed=dist.get_rank())
    attention_only = {f"model.layers.*.self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
    counter = CollectiveCount()
    try:
        with counter:
            parallelize(model, mesh, tp_plan=attention_only)
    except ValueError as error:
        assert "leaves large weights of LlamaForCausalLM's decoder blocks unsharded" in str(error), error
    else:
        raise AssertionError("the plan was not refused")
    assert counter.count == 0, f"{counter.count} collectives ran before the refusal"
    return {"collectives": counter.count}


def user_plan(model: torch.nn.Module, sp: bool) -> dict:
    """A plan as a user writes it for Llama, with torch's styles only: logits gathered, no sequence parallel."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    layer = "model.layers.*"
    plan = {f"{layer}.self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
    plan |= {f"{layer}.mlp.{p}_proj": ColwiseParallel() for p in ("gate", "up")}
    plan |= {f"{layer}.self_attn.o_proj": RowwiseParallel(), f"{layer}.mlp.down_proj": RowwiseParallel()}
    plan |= {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate())}
    plan |= {"lm_head": ColwiseParallel(output_layouts=Replicate())}
    return plan


def naive_fused_plan(model: torch.nn.Module, sp: bool) -> dict:
    """Phi3's family plan with its fused gate_up_proj split by torch's plain ColwiseParallel, which gives each rank
    gate or up rather than half of each: it runs, and trains wrong (what verify_plan must catch)."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    from lightning_automodel.parallel.tensor.plans.selection import select_tp_plan

    return {**select_tp_plan(model, sp=sp).plan, "model.layers.*.mlp.gate_up_proj": ColwiseParallel()}


def plan_with_a_stray_pattern(model: torch.nn.Module, sp: bool) -> dict:
    """The model's own plan and a pattern that matches no module, which the plan report names."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    from lightning_automodel.parallel.tensor.plans.selection import select_tp_plan

    return {**select_tp_plan(model, sp=sp).plan, "model.layers.*.mlp.no_such_proj": ColwiseParallel()}


USER_PLAN = user_plan(None, False)
# The Llama projections by name, and nothing else: per-head norms under other names (HunYuan's query_layernorm) are
# left to the probe.
LLAMA_NAMES_PLAN = {pattern: style for pattern, style in USER_PLAN.items() if "layers" in pattern}


def check_user_plan(spec: str) -> dict[str, float]:
    """tp_plan given as a dict, an import path to a dict, an import path to a function, or the function."""
    specs = {
        "dict": USER_PLAN,
        "dict path": "plan_checks.USER_PLAN",
        "function path": "plan_checks.user_plan",
        "function": user_plan,
    }
    mesh = dims_for(dist.get_world_size(), 2).build_mesh("cpu")
    reference, model = tiny_model(), tiny_model()
    parallelize(model, mesh, tp_plan=specs[spec])
    errors = forward_backward_errors(model, reference, data_mesh(mesh))
    assert max(errors.values()) < FP32_TOLERANCE, errors
    return errors


def check_phi3_attention_kept_whole() -> dict[str, float]:
    """A user plan may leave Phi3's attention replicated (the reference's layout): head counts stay global."""
    from lightning_automodel.parallel.tensor.plans.selection import select_tp_plan

    mesh = dims_for(dist.get_world_size(), 2).build_mesh("cpu")
    reference, model = tiny_model("phi3_gqa"), tiny_model("phi3_gqa")
    plan = select_tp_plan(model, sp=False).plan
    del plan["model.layers.*.self_attn.qkv_proj"], plan["model.layers.*.self_attn.o_proj"]
    parallelize(model, mesh, tp_plan=plan, allow_unsharded_linears=True)
    errors = forward_backward_errors(model, reference, data_mesh(mesh))
    assert max(errors.values()) < FP32_TOLERANCE, errors
    return errors
