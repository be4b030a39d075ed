"""Pipeline parallel (``pp``) against one process, through a real Trainer: 3 AdamW steps (the loss at each step, this
stage's gradients at each step, the weights after) and validate's loss, with torch's GPipe and 1F1B schedules; a tied
embedding (Gemma 3: its two copies' gradients summed); pp=2 x dp_shard=2; a loss computed from the logits and every
bad option refused on every rank."""

from functools import partial

from harness import run_checks
from pipeline_checks import check_loss_from_logits_is_refused, check_pipeline_refusals, check_pipeline_trainer_parity


def test_pipeline_two_stages_against_one_process():
    """World 2 at pp=2: Llama with 1F1B over 4 micro-batches, Gemma 3 (tied embeddings) with GPipe; a training_step
    computing its loss from the logits stops at its first step, naming the call that works."""
    checks = [
        partial(check_pipeline_trainer_parity, 2, "1F1B", microbatches=4),
        partial(check_pipeline_trainer_parity, 2, "GPipe", "gemma3"),
        partial(check_loss_from_logits_is_refused, 2),
    ]
    run_checks(2, checks, timeout=300)


def test_pipeline_with_data_parallel_and_refusals():
    """World 4: Qwen3 at pp=2 x dp_shard=2 (1F1B, activation checkpointing); refusals before any collective."""
    checks = [
        partial(check_pipeline_trainer_parity, 2, "1F1B", "qwen3", activation_checkpointing=True),
        partial(check_pipeline_refusals, 2),
    ]
    run_checks(4, checks, timeout=300)
