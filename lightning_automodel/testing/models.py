"""Tiny Hugging Face models built from configs (no hub), identical on every process for a given seed."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    Ernie4_5_MoeConfig,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from lightning_automodel.hf import shrink
from lightning_automodel.planning.replica_comparison import SEQ_LEN, token_batch

VOCAB = shrink.VOCAB  # that of every tiny model, the coverage report's too
SEQ = SEQ_LEN


CONFIGS = {
    "llama": LlamaConfig,
    "mistral": MistralConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "qwen3_cls": Qwen3Config,
    "gemma3": Gemma3TextConfig,
    "gemma3_vlm": Gemma3TextConfig,
    "phi3": Phi3Config,
    "phi3_gqa": Phi3Config,
    "granite": GraniteConfig,  # no registered plan: trained through its Hugging Face plan
    # Mixture of experts: 4 fused experts, top-2, a shared expert; its router is pinned to fp32
    # (_keep_in_fp32_modules_strict).
    "ernie_moe": Ernie4_5_MoeConfig,
}
FAMILIES = tuple(name for name in CONFIGS if name not in ("granite", "ernie_moe"))
# Mixture-of-experts families with the coverage report's tiny config (lightning_automodel/hf/shrink.py): Qwen3-MoE,
# Mixtral, GPT-OSS (interleaved gate/up stored (in, out), expert biases, attention sinks) and DeepSeek-V3 (latent
# attention, shared experts, grouped routing).
SHRUNK = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "llama4_text")


def tiny_config(family: str = "llama", **overrides):
    if family in SHRUNK:
        config = shrink.tiny_config(family)
        for name, value in overrides.items():
            setattr(config, name, value)
        return config
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    if family in ("qwen3", "qwen3_cls", "gemma3", "gemma3_vlm"):
        common.update(head_dim=16)
    if family.startswith("gemma3"):
        common.update(sliding_window=8, query_pre_attn_scalar=16, tie_word_embeddings=True)
    if family == "qwen3_cls":
        common.update(num_labels=3)
    if family == "granite":  # its multipliers make it differ from Llama
        common.update(embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=4.0, attention_multiplier=0.2)
    if family == "ernie_moe":
        common.update(
            moe_intermediate_size=32, moe_num_experts=4, moe_k=2, moe_layer_start_index=0, moe_num_shared_experts=1
        )
    if family == "phi3":
        common.update(num_key_value_heads=4)  # fused [q; k; v] of equal blocks (Phi-3-mini)
    if family == "phi3_gqa":
        common.update(num_key_value_heads=2)  # grouped KV heads: unequal blocks (Phi-3-medium, Phi-4-mini)
    common.update(overrides)
    text = CONFIGS[family](**common)
    if family == "gemma3_vlm":
        vision = dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=16,
            patch_size=8,
        )
        return Gemma3Config(
            text_config=text.to_dict(),
            vision_config=vision,
            mm_tokens_per_image=4,
            image_token_index=VOCAB - 1,
            tie_word_embeddings=text.tie_word_embeddings,
        )
    return text


def tiny_model(family: str = "llama", seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    if family == "gemma3_vlm":
        return Gemma3ForConditionalGeneration(config)
    if family == "qwen3_cls":
        return AutoModelForSequenceClassification.from_config(config)
    return AutoModelForCausalLM.from_config(config)


def batch(batch_size: int = 4, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token labels of the tiny vocabulary, padded as ``verify_plan``'s batch is: the last two
    labels of every sequence are ignored (-100), so a mean over any split of the batch equals the global mean."""
    return token_batch(VOCAB, batch_size=batch_size, seed=seed)


def tiny_tokenizer():
    """A word-level tokenizer over the tiny vocabulary, built offline."""
    tokenizer = Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w1"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="w0", unk_token="w1")
