"""PEFT LoRA models under TP, SP and FSDP2, against a single-process PEFT model."""

from functools import partial

import pytest
from lora_checks import (
    check_lora_adds_no_forward_collective,
    check_lora_bf16_base,
    check_lora_resume,
    check_lora_trainer,
    check_lora_training,
    check_peft_exports,
    peft_model,
)

from lightning_automodel.testing.harness import run_checks
from lightning_automodel.testing.trainer_checks import check_trainer_gradient_clipping

ATTENTION = ("q_proj", "v_proj", "o_proj")


def test_lora_on_two_ranks():
    """tp=2 with sp on every projection; biases trained and lora_bias (Qwen2); Phi3's packed and regrouped
    projections (grouped-query); DoRA without sp; a bf16 base with fp32 adapters; clipping; the Trainer with
    checkpointing; resuming from a checkpoint of the adapters alone. Without sp, Phi3's multi-head layout and the
    bf16 base in one process: the sweep below."""
    checks = [check_lora_adds_no_forward_collective]
    checks.append(partial(check_lora_training, 2, True))
    checks.append(
        partial(check_lora_training, 2, True, family="qwen2", targets=ATTENTION, bias="all", lora_bias=True, r=3)
    )
    checks.append(partial(check_lora_training, 2, True, family="phi3_gqa"))
    checks.append(partial(check_lora_training, 2, False, targets=(*ATTENTION, "down_proj"), use_dora=True))
    checks.append(partial(check_lora_bf16_base, 2))
    checks.append(partial(check_trainer_gradient_clipping, 2, True, peft_model, 1.0))
    checks.append(partial(check_lora_trainer, 2, False, True))
    checks.append(partial(check_lora_resume, 2))
    run_checks(2, checks)


@pytest.mark.sweep
def test_lora_on_two_ranks_without_sequence_parallel():
    checks = [partial(check_lora_training, 2, False), partial(check_lora_training, 2, False, family="phi3")]
    run_checks(2, [*checks, partial(check_lora_bf16_base, 1)])


def test_lora_on_four_ranks():
    """tp=2 x dp_shard=2 with sp, with full activation checkpointing (selective: the sweep below); through the
    Trainer too; the adapter and merged exports (LoRA and DoRA) round trip through PEFT and transformers in one
    process."""
    checks = [partial(check_lora_training, 2, True, True), partial(check_lora_trainer, 2, True, True)]
    checks += [partial(check_peft_exports, 2, True), partial(check_peft_exports, 2, False, use_dora=True)]
    run_checks(4, checks)


@pytest.mark.sweep
def test_lora_with_selective_checkpointing_on_four_ranks():
    """tp=2 x dp_shard=2 with sp and selective checkpointing (the suite: selective without LoRA, and LoRA under full
    checkpointing)."""
    run_checks(4, [partial(check_lora_training, 2, True, "selective")])
