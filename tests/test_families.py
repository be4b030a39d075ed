"""Every registered family at tp=2, with and without sequence parallel, against a single process."""

from functools import partial

from harness import run_checks
from lightning_checks import check_meta_model_from_configure_model, check_trainer_parity
from models import FAMILIES
from parity import (
    check_family,
    check_frozen_stays_frozen,
    check_naive_plan_is_wrong,
    check_phi3_attention_kept_whole,
)
from torch.distributed.tensor.parallel import ColwiseParallel

SP = (False, True)


def test_forward_backward_parity_of_every_family():
    checks = [partial(check_family, family, sp) for family in FAMILIES for sp in SP]
    checks.append(check_phi3_attention_kept_whole)  # a user plan that keeps attention whole stays correct
    run_checks(2, checks)


def test_no_family_style_unfreezes_a_frozen_parameter():
    """Head-sharded norms, packed and regrouped projections, sequence-parallel norms: frozen stays frozen."""
    families = ("qwen3", "gemma3", "phi3", "phi3_gqa")
    run_checks(2, [partial(check_frozen_stays_frozen, True, family) for family in families])


def test_three_adamw_steps_of_every_family():
    run_checks(2, [partial(check_trainer_parity, 2, sp, False, family) for family in FAMILIES for sp in SP])


def test_a_model_without_family_plan_trains_through_its_hugging_face_plan():
    """Granite (multipliers on embeddings, residuals and logits) has no registered plan; transformers ships one."""
    run_checks(2, [partial(check_family, "granite", False), partial(check_trainer_parity, 2, False, True, "granite")])


def test_family_plans_on_tp_times_fsdp():
    """tp=2 x dp_shard=2: FSDP over Phi3's packed and regrouped projections, tied Gemma3 embeddings."""
    checks = [partial(check_family, family, True) for family in ("phi3", "phi3_gqa", "gemma3", "qwen3")]
    checks.append(partial(check_trainer_parity, 2, True, True, "phi3"))
    # Meta-device builds: each rank initialises its slice of the packed and tied weights, as HF would.
    checks += [partial(check_meta_model_from_configure_model, 2, family) for family in ("phi3", "gemma3")]
    run_checks(4, checks)


def test_what_the_reference_does_is_wrong():
    """Leaving q_norm/k_norm plain (the reference) or sharding fused projections naively gives wrong gradients."""
    layer = "model.layers.*"
    qk_norms_left_alone = {f"{layer}.self_attn.q_norm": None, f"{layer}.self_attn.k_norm": None}
    naive_gate_up = {f"{layer}.mlp.gate_up_proj": ColwiseParallel()}
    naive_qkv = {f"{layer}.self_attn.qkv_proj": ColwiseParallel()}
    checks = [
        partial(check_naive_plan_is_wrong, "qwen3", qk_norms_left_alone),
        partial(check_naive_plan_is_wrong, "gemma3", qk_norms_left_alone),
        partial(check_naive_plan_is_wrong, "phi3", naive_gate_up),
        partial(check_naive_plan_is_wrong, "phi3", naive_qkv),
    ]
    results = run_checks(2, checks)
    for name, per_rank in results.items():
        errors = per_rank[0]
        assert errors["grad"] > 1e-2, f"{name}: expected wrong gradients, got {errors}"
    for name in list(results)[2:]:
        assert results[name][0]["logits"] > 1e-2, f"{name}: naive fused sharding should change the logits"
