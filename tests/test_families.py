"""Every registered family at tp=2, with and without sequence parallel, against a single process."""

from functools import partial

import pytest
from lightning_checks import check_meta_model_from_configure_model
from plan_checks import (
    check_frozen_stays_frozen,
    check_naive_plan_is_wrong,
    check_phi3_attention_kept_whole,
    check_plan_alone_is_wrong,
    check_plan_of_any_model,
    check_refusal_before_any_collective,
)
from torch.distributed.tensor.parallel import ColwiseParallel

from lightning_automodel.testing.harness import check_name, run_checks
from lightning_automodel.testing.models import FAMILIES
from lightning_automodel.testing.parallelize_checks import check_family
from lightning_automodel.testing.trainer_checks import check_trainer_parity

PLAIN_TP = ("llama", "phi3", "gemma3")  # without sequence parallel in the default run


def test_forward_backward_parity_of_every_family():
    """With sequence parallel; without it, Llama, Phi3 and Gemma3 (packed projections, tied embeddings), the other
    families in the sweep below."""
    checks = [partial(check_family, family, True) for family in FAMILIES]
    checks += [partial(check_family, family, False) for family in PLAIN_TP]
    checks.append(check_phi3_attention_kept_whole)  # a user plan that keeps attention whole stays correct
    run_checks(2, checks)


@pytest.mark.sweep
def test_forward_backward_parity_of_every_family_without_sequence_parallel():
    run_checks(2, [partial(check_family, family, False) for family in FAMILIES if family not in PLAIN_TP])


def test_no_family_style_unfreezes_a_frozen_parameter():
    """Head-sharded norms, packed and regrouped projections, sequence-parallel norms: frozen stays frozen."""
    families = ("qwen3", "gemma3", "phi3", "phi3_gqa")
    run_checks(2, [partial(check_frozen_stays_frozen, True, family) for family in families])


# Three AdamW steps through the Trainer in the default run: a plain, a packed-projection and a tied-embedding family
# (every family's forward and backward above); the rest behind -m sweep.
TRAINED = ("llama", "phi3", "gemma3")


def test_three_adamw_steps_of_families():
    """With sequence parallel; without it, and the other families, the sweeps below."""
    run_checks(2, [partial(check_trainer_parity, 2, True, False, family) for family in TRAINED])


@pytest.mark.sweep
def test_three_adamw_steps_of_every_other_family():
    others = [family for family in FAMILIES if family not in TRAINED]
    run_checks(2, [partial(check_trainer_parity, 2, True, False, family) for family in others])


@pytest.mark.sweep
def test_three_adamw_steps_of_every_family_without_sequence_parallel():
    run_checks(2, [partial(check_trainer_parity, 2, False, False, family) for family in FAMILIES])


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


def test_mixture_of_experts_on_tp_times_fsdp():
    """ERNIE-4.5-MoE (fused experts split on their intermediate units, a shared expert, an fp32 router) at tp=2 x
    dp_shard=2: FSDP over the strided expert shards, the experts block on the sequence-parallel stream, activation
    checkpointing recomputing the experts on local parameters; 3 AdamW steps against one process."""
    checks = [partial(check_trainer_parity, 2, sp, sp, "ernie_moe") for sp in (False, True)]
    run_checks(4, checks)


def test_modules_on_sharded_activations_are_found_whatever_their_names():
    """Per-head norms under any name, xIELU's learned scalars: the probe finds every plain parameter computing on
    sharded activations and makes its gradient right. HunYuan's query_layernorm/key_layernorm under a user plan that
    names only the Llama projections; Apertus (and its xIELU) and Qwen3 with the plans parallelize picks; BitNet's
    norm over the sharded attention output; StableLM's attention reading global head counts. The same plans applied
    by torch alone (as the reference does) run and are wrong; then also a model with real weights is refused before
    any collective."""
    checks = [
        partial(check_plan_of_any_model, "hunyuan_v1_dense", "llama names"),
        partial(check_plan_of_any_model, "apertus", "chosen"),
        partial(check_plan_of_any_model, "bitnet", "chosen"),
        partial(check_plan_of_any_model, "stablelm", "chosen"),
    ]
    wrong = [
        partial(check_plan_alone_is_wrong, "hunyuan_v1_dense", "llama names"),
        partial(check_plan_alone_is_wrong, "apertus", "chosen"),
        partial(check_plan_alone_is_wrong, "qwen3", "chosen"),
    ]
    results = run_checks(2, [*checks, *wrong, check_refusal_before_any_collective])
    for check in wrong:
        errors = results[check_name(check)][0]
        assert errors["grad"] > 1e-2, f"{check_name(check)}: expected wrong gradients, got {errors}"


def test_what_the_reference_does_is_wrong():
    """Sharding fused projections naively gives wrong gradients and logits (q/k norms left plain: see above)."""
    layer = "model.layers.*"
    naive_gate_up = {f"{layer}.mlp.gate_up_proj": ColwiseParallel()}
    naive_qkv = {f"{layer}.self_attn.qkv_proj": ColwiseParallel()}
    checks = [
        partial(check_naive_plan_is_wrong, "phi3", naive_gate_up),
        partial(check_naive_plan_is_wrong, "phi3", naive_qkv),
    ]
    results = run_checks(2, checks)
    for name, per_rank in results.items():
        errors = per_rank[0]
        assert errors["grad"] > 1e-2, f"{name}: expected wrong gradients, got {errors}"
        assert errors["logits"] > 1e-2, f"{name}: naive fused sharding should change the logits"
