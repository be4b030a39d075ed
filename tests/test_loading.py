"""Pretrained Hugging Face checkpoints loaded shard by shard into parallelized models (one launch of four)."""

from functools import partial

import pytest
from loading_checks import (
    check_export_failure_on_rank0,
    check_export_round_trip,
    check_loaded_dtypes,
    check_loaded_weights,
    check_pretrained_peft,
    check_pretrained_trainer,
)

from lightning_automodel.testing.harness import run_checks


def test_pretrained_loading_and_export_on_four_ranks():
    """tp=2 x dp_shard=2: Llama, the Qwen3 classifier; Gemma3 (tied, sharded files) with sp; Phi3's
    packed and regrouped projections with grouped KV heads; Gemma3's multimodal model, whose checkpoint names differ
    from its modules; through the Trainer; dtypes; a PEFT model over a pretrained base. Then exports of Qwen3 and
    Gemma3 back to Hugging Face directories, and an export failing on rank 0. More families: the sweep below."""
    checks = [
        partial(check_loaded_weights, "qwen3_cls", 2, True),
        partial(check_loaded_weights, "gemma3", 2, True, "20KB"),
        partial(check_loaded_weights, "phi3_gqa", 2, True),
        partial(check_loaded_weights, "gemma3_vlm", 2, False),
        partial(check_pretrained_trainer, "llama", 2),
        check_loaded_dtypes,
        partial(check_pretrained_peft, 2, True),
        *(partial(check_export_round_trip, family, 2, True) for family in ("qwen3", "gemma3")),
        check_export_failure_on_rank0,
    ]
    run_checks(4, checks)


@pytest.mark.sweep
def test_pretrained_loading_and_export_of_more_families():
    """tp=2 x dp_shard=2: Qwen3 with sp (exported in the default run), Llama (through the Trainer there), Mistral with
    sp, Qwen2, Phi3; exports of Llama and Phi3."""
    checks = [
        partial(check_loaded_weights, "qwen3", 2, True),
        partial(check_loaded_weights, "llama", 2, False),
        partial(check_loaded_weights, "mistral", 2, True),
        partial(check_loaded_weights, "qwen2", 2, False),
        partial(check_loaded_weights, "phi3", 2, False),
        *(partial(check_export_round_trip, family, 2, False) for family in ("llama", "phi3")),
    ]
    run_checks(4, checks)


def test_pretrained_loading_of_layouts_found_by_structure():
    """tp=2: checkpoints of a Mamba-2 hybrid (the in_proj regrouped, the convolution whole, per-head parameters and the
    norm split; with sp), a Mamba hybrid with experts (Jamba), a multi-query model (GPT-BigCode, its fused [q; k; v]
    regrouped) and Kimi's delta attention (the convolution and gated norm whole, decay parameters split by head inside
    its forget gate), loaded shard by shard: every weight, then loss, logits and gradients, as transformers' own
    load."""
    checks = [
        partial(check_loaded_weights, "type:bamba", 2, True),
        partial(check_loaded_weights, "type:jamba", 2, False),
        partial(check_loaded_weights, "type:gpt_bigcode", 2, False),
        partial(check_loaded_weights, "type:kimi_linear", 2, True),
    ]
    run_checks(2, checks)
