"""Tiny Hugging Face models built from configs (no hub), identical on every process for a given seed."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

VOCAB = 128
SEQ = 16


def tiny_config(family: str = "llama", **overrides):
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
    common.update(overrides)
    config_class = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[family]
    return config_class(**common)


def tiny_model(family: str = "llama", seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(family, **overrides))


def batch(batch_size: int = 4, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token labels. The last two labels of every sequence are ignored (-100), as padding
    would be; every sequence ignores as many, so a mean over any split of the batch equals the global mean."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (batch_size, SEQ + 1), generator=generator)
    labels = tokens[:, 1:].clone()
    labels[:, -2:] = -100
    tokens[:, -2:] = 0  # pad tokens in the input too: the vocab-parallel embedding must keep padding_idx right
    return tokens[:, :-1], labels
