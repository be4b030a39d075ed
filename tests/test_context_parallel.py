"""Context parallel (``cp``) against one process on the whole batch: 3 AdamW steps through a real Trainer (the loss
at each step, every gradient at each step, the weights after) and validate's loss; the model's call on packed
documents, right-padded rows of a length 2 cp does not divide, soft-capped attention (Gemma 2) and attention sinks
(GPT-OSS): the loss, this rank's logits and every gradient, and under flex attention the loss and logits of an
evaluation call (its backward does not run on CPU); sliding windows shorter and longer than a rank's chunk
(rows of 16 tokens: chunks of 4 at cp=2); CausalLMModule; LoRA; a checkpoint saved at cp=2 resumed at cp=1; and the
refusals."""

from functools import partial

import pytest
import torch
from context_parallel_checks import (
    check_context_parallel_lora,
    check_context_parallel_refusals,
    check_rows_split_over_cp,
    check_rows_split_over_pp_and_cp,
)
from lightning_checks import check_checkpoint_resume_across_layouts
from lm_checks import AUXILIARY, check_causal_lm_module_split

from lightning_automodel import AutoModelParallelStrategy
from lightning_automodel.parallel.context_parallel import attention_kernel, documents, token_indices
from lightning_automodel.testing.harness import run_checks
from lightning_automodel.testing.trainer_checks import (
    check_bf16_trainer,
    check_context_parallel_trainer_parity,
    check_pipeline_trainer_parity,
)

# Gemma 3 with a full-attention and a sliding layer, its window (3 tokens) shorter than a rank's chunk (4)
GEMMA3_SHORT_WINDOW = dict(layer_types=["full_attention", "sliding_attention"], sliding_window=3)
GEMMA3_EIGHT_LAYERS = dict(GEMMA3_SHORT_WINDOW, layer_types=["full_attention", "sliding_attention"] * 4)
ROWS = partial(check_rows_split_over_pp_and_cp, pp=2)  # the rest of the world is cp
CP_ROWS = partial(check_rows_split_over_cp, length=16, packed=False, padded=False)
INTERLEAVED = dict(schedule="Interleaved1F1B", stages_per_rank=2)


def test_context_parallel_on_two_ranks(tmp_path):
    """World 2 at cp=2: Llama, and Gemma 3 with a window shorter than a chunk, through the Trainer; the model's call
    on three packed documents a row (Llama; Mistral with a window longer than a chunk), on right-padded rows of 15
    tokens, with Gemma 2's soft-capped logits and GPT-OSS's sinks; under flex attention (evaluation calls, training
    refused on CPU) packed and padded rows and Gemma 3's mixed windows (soft-capping and sinks under flex: the
    sweep below); CausalLMModule unchanged, and with a mixture-of-experts model's load-balancing loss over every
    token (Qwen3-MoE); bf16 (mixed and true) as close to fp32 as one bf16 process; LoRA; a checkpoint saved at cp=2
    resumed at cp=1 with the uninterrupted run's losses; refusals."""
    checks = [
        partial(check_context_parallel_trainer_parity, 2),
        partial(check_context_parallel_trainer_parity, 2, "gemma3", config=GEMMA3_SHORT_WINDOW),
        partial(CP_ROWS, "llama", packed=True),
        partial(CP_ROWS, "mistral", packed=True, sliding_window=6),
        partial(CP_ROWS, "llama", padded=True, length=15),
        partial(CP_ROWS, "gemma2"),
        partial(CP_ROWS, "gpt_oss"),
        partial(CP_ROWS, "llama", packed=True, attention="flex"),
        partial(CP_ROWS, "llama", padded=True, length=15, attention="flex"),
        partial(CP_ROWS, "gemma3", attention="flex", **GEMMA3_SHORT_WINDOW),
        partial(check_causal_lm_module_split, cp=2),
        partial(check_causal_lm_module_split, cp=2, family="qwen3_moe"),
        partial(check_bf16_trainer, 1, "bf16-mixed", cp=2),
        partial(check_bf16_trainer, 1, "bf16-true", cp=2),
        partial(check_context_parallel_lora, 2),
        partial(check_checkpoint_resume_across_layouts, str(tmp_path), [(dict(cp=2), {})], "llama"),
        partial(check_context_parallel_refusals, 2),
    ]
    run_checks(2, checks, timeout=400)


def test_context_parallel_with_tensor_and_data_parallel():
    """World 4: Llama at cp=2 x tp=2 with sp; Qwen3 at cp=2 x dp_shard=2 with activation checkpointing; Mistral with a
    3-token window at cp=2 x tp=2; CausalLMModule at cp=2 x tp=2 on packed rows. Under pp=2 x cp=2: Llama through the
    Trainer (1F1B); the model's call on rows padded and packed each their own way, under 1F1B (Llama) and
    Interleaved1F1B (Gemma 3: tied, sliding layers); CausalLMModule on pretrained Qwen3-MoE with its load-balancing
    loss.
    The sweep below: the other schedules and more families."""
    checks = [
        partial(check_context_parallel_trainer_parity, 2, tp=2, sp=True),
        partial(check_context_parallel_trainer_parity, 2, "qwen3", activation_checkpointing=True),
        partial(check_context_parallel_trainer_parity, 2, "mistral", tp=2, config=dict(sliding_window=3)),
        partial(check_causal_lm_module_split, cp=2, tp=2, rows="packed"),
        partial(check_pipeline_trainer_parity, 2, "1F1B", microbatches=2, cp=2),
        partial(ROWS, "llama"),
        partial(ROWS, "gemma3", **INTERLEAVED, **GEMMA3_EIGHT_LAYERS),
        partial(check_causal_lm_module_split, pp=2, cp=2, family="qwen3_moe"),
    ]
    run_checks(4, checks, timeout=400)


@pytest.mark.sweep
def test_context_parallel_flex_sweep():
    """World 2 at cp=2 under flex attention: Gemma 2's soft-capped logits and GPT-OSS's sinks (the suite: both
    under sdpa, and flex on packed, padded and Gemma 3's rows)."""
    run_checks(2, [partial(CP_ROWS, family, attention="flex") for family in ("gemma2", "gpt_oss")], timeout=400)


@pytest.mark.sweep
def test_pipeline_with_context_parallel_sweep():
    """World 4 at pp=2 x cp=2: the model's call under GPipe (Qwen3), LoopedBFS and InterleavedZeroBubble (Llama),
    Qwen3-MoE's load-balancing loss under 1F1B and Interleaved1F1B; through the Trainer, Gemma 3 under GPipe with
    activation checkpointing and Qwen3-MoE with its load-balancing loss."""
    checks = [
        partial(ROWS, "qwen3", schedule="GPipe"),
        partial(ROWS, "llama", schedule="LoopedBFS", stages_per_rank=2),
        partial(ROWS, "llama", schedule="InterleavedZeroBubble", stages_per_rank=2),
        partial(ROWS, "qwen3_moe", **AUXILIARY),
        partial(ROWS, "qwen3_moe", **INTERLEAVED, **AUXILIARY),
        partial(check_pipeline_trainer_parity, 2, "GPipe", "gemma3", cp=2, activation_checkpointing=True),
        partial(check_pipeline_trainer_parity, 2, "1F1B", "qwen3_moe", microbatches=2, cp=2, config=AUXILIARY),
    ]
    run_checks(4, checks, timeout=600)


def test_split_covers_every_token_once_and_balances_causal_work():
    """Rank i holds chunks i and 2 cp - 1 - i of 2 cp: together the ranks hold each position once, and under the
    causal mask each rank's queries see as many keys as any other's. Documents start where positions do not
    continue."""
    for cp, length in ((2, 16), (4, 64), (8, 128)):
        held = [token_indices(length, cp, rank) for rank in range(cp)]
        assert sorted(torch.cat(held).tolist()) == list(range(length))
        work = {int((positions[:, None] >= torch.arange(length)).sum()) for positions in held}
        assert len(work) == 1, (cp, work)
    assert documents(torch.tensor([[0, 1, 2, 0, 1, 0], [5, 6, 7, 8, 9, 10]])).tolist() == [
        [1, 1, 1, 2, 2, 3],
        [1, 1, 1, 1, 1, 1],
    ]


def test_attention_kernel_by_device_and_name():
    """ "auto" is flex attention on GPUs (fused, block-sparse) and SDPA on CPU (where flex attention cannot train); an
    unknown kernel is refused when the strategy is built."""
    assert [attention_kernel("auto", device) for device in ("cuda", "cpu")] == ["flex", "sdpa"]
    assert attention_kernel("flex", "cpu") == "flex"
    with pytest.raises(ValueError, match="use 'auto'"):
        AutoModelParallelStrategy(cp=2, cp_attention="ring")
