"""Pipeline parallel (``pp``) against one process, through a real Trainer: 3 AdamW steps (the loss at each step, this
stage's gradients at each step, the weights after) and validate's loss, with torch's GPipe and 1F1B schedules; a tied
embedding (Gemma 3: its two copies' gradients summed); gradient accumulation and clipping; pp=2 x tp=2 with sp,
pp=2 x dp_shard=2, pp=2 under HSDP; LoRA; pretrained loading; Lightning checkpoints resumed across pp and tp sizes; a
loss computed from the logits and every bad option refused on every rank."""

from functools import partial

from harness import run_checks
from pipeline_checks import (
    check_causal_lm_module_pipelined,
    check_loss_from_logits_is_refused,
    check_pipeline_accumulation_and_clipping,
    check_pipeline_batch_shapes,
    check_pipeline_checkpoint_resume,
    check_pipeline_loaded_weights,
    check_pipeline_lora,
    check_pipeline_refusals,
    check_pipeline_trainer_parity,
)


def test_pipeline_two_stages_against_one_process():
    """World 2 at pp=2: Llama with 1F1B over 4 micro-batches, Gemma 3 (tied embeddings) with GPipe, and with
    accumulate_grad_batches=2 and gradient_clip_val; pretrained Llama and Gemma 3 loaded stage by stage; CausalLMModule
    unchanged (loss, accuracy, validation metrics); batches of other shapes one after another; a training_step
    computing its loss from the logits stops at its first step, naming the call that works."""
    checks = [
        partial(check_pipeline_trainer_parity, 2, "1F1B", microbatches=4),
        partial(check_pipeline_trainer_parity, 2, "GPipe", "gemma3"),
        partial(check_pipeline_accumulation_and_clipping, 2),
        partial(check_pipeline_loaded_weights, 2, "llama"),
        partial(check_pipeline_loaded_weights, 2, "gemma3"),
        partial(check_causal_lm_module_pipelined, 2),
        partial(check_pipeline_batch_shapes, 2),
        partial(check_loss_from_logits_is_refused, 2),
    ]
    run_checks(2, checks, timeout=400)


def test_pipeline_with_tensor_and_data_parallel(tmp_path):
    """World 4: Llama at pp=2 x tp=2 with sp (1F1B, 4 micro-batches); Gemma 3 (tied, its embedding vocabulary-parallel)
    at pp=2 x tp=2 with sp (GPipe); Qwen3 at pp=2 x dp_shard=2 with activation checkpointing; Llama at pp=2 under HSDP
    (dp_replicate=2); LoRA on every projection at pp=2 x tp=2 with sp; checkpoints saved at pp=2 x dp_shard=2 resumed
    at pp=2 x tp=2 and at pp=1 (dp_shard=4), and saved at pp=1 resumed at pp=2 x tp=2; refusals before any
    collective."""
    pp2, pp2_tp2 = dict(pp=2), dict(pp=2, tp=2)
    checks = [
        partial(check_pipeline_trainer_parity, 2, "1F1B", microbatches=4, tp=2, sp=True),
        partial(check_pipeline_trainer_parity, 2, "GPipe", "gemma3", tp=2, sp=True),
        partial(check_pipeline_trainer_parity, 2, "1F1B", "qwen3", activation_checkpointing=True),
        partial(check_pipeline_trainer_parity, 2, "GPipe", dp_replicate=2),
        partial(check_pipeline_lora, 2, 2, True),
        partial(check_pipeline_checkpoint_resume, str(tmp_path), [(pp2, pp2_tp2), (pp2, {}), ({}, pp2_tp2)]),
        partial(check_pipeline_refusals, 2),
    ]
    run_checks(4, checks, timeout=400)
