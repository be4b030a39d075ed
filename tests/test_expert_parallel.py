"""Expert parallel (``ep``) against one process: the MoE families through the Trainer at ep=2 alone, with tp=2 and
sp, with FSDP over the experts (efsdp=2), with activation checkpointing and bf16; uneven expert load; pretrained
loading, export and checkpoints resumed at other ep sizes. The full sweep (every family at every layout) is
scripts/expert_parallel_sweep.py."""

from functools import partial

import pytest
from checkpoint_checks import assert_converted, check_save_then_resume_at_ep_sizes
from expert_checks import check_each_rank_reads_its_experts, check_expert_parallel_refusals, check_uneven_expert_load
from loading_checks import check_export_round_trip, check_loaded_weights
from lora_checks import check_lora_training

from lightning_automodel.testing.harness import run_checks
from lightning_automodel.testing.trainer_checks import check_bf16_trainer, check_trainer_parity

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def test_expert_parallel_families_through_the_trainer():
    """World 4, 3 AdamW steps against one process: Qwen3-MoE at ep=2 with FSDP over the other 2 (efsdp=2) and
    activation checkpointing; DeepSeek-V3 at ep=2 under HSDP (dp_replicate=2); GPT-OSS at ep=2 x tp=2 with sp;
    GPT-OSS with every token routed to half of the experts; LoRA on Qwen3-MoE's attention at ep=2 x tp=2 with sp.
    Pretrained loading at ep=2 x tp=2 with sp equal to transformers' own, of GPT-OSS (experts stored fused:
    interleaved gate/up, biases); each rank reads its experts' tensors only. Behind -m sweep: Llama 4 (every token
    for every expert, its rows sent to the rank holding the expert) at ep=2 x tp=2 with sp, and Qwen3-MoE's load
    (stored one tensor per expert and projection). More in the sweeps below; every family at every layout, with and
    without checkpointing, and bf16 for all: scripts/expert_parallel_sweep.py."""
    checks = [
        partial(check_trainer_parity, 1, False, True, "qwen3_moe", ep=2),
        partial(check_trainer_parity, 1, False, False, "deepseek_v3", dp_replicate=2, ep=2),
        partial(check_trainer_parity, 2, True, False, "gpt_oss", ep=2),
        partial(check_uneven_expert_load, 2),
        partial(check_lora_training, 2, True, family="qwen3_moe", ep=2, targets=ATTENTION),
        partial(check_loaded_weights, "gpt_oss", 2, True, ep=2),
        partial(check_each_rank_reads_its_experts, 2),
    ]
    run_checks(4, checks, timeout=480)


@pytest.mark.sweep  # Llama 4's experts (each token for every expert) and Qwen3-MoE's load of one tensor an expert
def test_expert_parallel_families_through_the_trainer_sweep():
    checks = [
        partial(check_trainer_parity, 2, True, False, "llama4_text", ep=2),
        partial(check_loaded_weights, "qwen3_moe", 2, True, ep=2),
    ]
    run_checks(4, checks, timeout=480)


@pytest.mark.sweep
def test_expert_parallel_sweep():
    """World 4: DeepSeek-V3 at ep=2 x tp=2 with sp; Qwen3-MoE in bf16-mixed at ep=2 and ERNIE-4.5-MoE in bf16-true
    (its router pinned to fp32 stays so), within the bf16 noise of one process; Llama 4 at ep=2 with FSDP over the
    other 2 (efsdp=2); Qwen3-MoE's export at ep=4, read back by transformers."""
    checks = [
        partial(check_trainer_parity, 1, False, False, "llama4_text", ep=2),
        partial(check_bf16_trainer, 1, "bf16-mixed", "qwen3_moe", ep=2),
        partial(check_export_round_trip, "qwen3_moe", 1, False, ep=4),
        partial(check_trainer_parity, 2, True, False, "deepseek_v3", ep=2),
        partial(check_bf16_trainer, 1, "bf16-true", "ernie_moe", ep=2),
    ]
    run_checks(4, checks, timeout=480)


def test_expert_parallel_checkpoints_resume_at_other_ep_sizes(tmp_path):
    """Saved at ep=2 x efsdp=2 (world 4) and resumed there exactly; resumed at ep=4 and at ep=1 with the losses of
    the uninterrupted run. Refusals of ep sizes that do not fit the model, before any collective. Exported shard by
    shard: every expert of every layer, as save_pretrained writes them."""
    save_and_resume = partial(check_save_then_resume_at_ep_sizes, str(tmp_path), "qwen3_moe", (4, 1))
    run_checks(4, [save_and_resume, check_expert_parallel_refusals])
    assert_converted(tmp_path, "qwen3_moe")
