"""What the peer benchmarks share (benchmarks/peers.py, benchmarks/torchtitan_peer.py): the Llama-shaped model every
peer starts from, the batch, the layouts, ours parallelized as AutoModelParallelStrategy does it, and the step."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import loss_parallel
from transformers import AutoModelForCausalLM, LlamaConfig

from lightning_automodel import ParallelDims, parallelize

CONFIG = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
ROWS, TOKENS, STEPS, WARMUP = 8, 256, 20, 2  # ROWS: the global batch
LAYOUTS = ((2, 2), (2, 1), (1, 2))  # (dp_shard, tp); sequence parallel wherever tp > 1
LR = 1e-3


def our_model(mesh_shape: tuple[int, int]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Ours over (dp_shard, tp), sequence parallel wherever tp > 1: ``parallelize(model, mesh, sp=tp > 1)``, the call
    AutoModelParallelStrategy makes; and its optimizer."""
    model = seeded_model()
    dp, tp = mesh_shape
    parallelize(model, ParallelDims(dp_shard=dp, tp=tp).resolve(dp * tp).build_mesh("cpu"), sp=tp > 1)
    return model, adamw(model)


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR)


def step(model, optimizer, tokens: torch.Tensor) -> torch.Tensor:
    """One AdamW step on next-token cross-entropy over the vocabulary-sharded logits; the loss."""
    optimizer.zero_grad(set_to_none=True)
    with loss_parallel():
        logits = model(input_ids=tokens, use_cache=False).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
    optimizer.step()
    return loss.detach()


def seeded_model():
    """The Llama every peer starts from, the same weights in every process."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG, attn_implementation="sdpa"))


def global_batch() -> torch.Tensor:
    return torch.randint(0, CONFIG["vocab_size"], (ROWS, TOKENS), generator=torch.Generator().manual_seed(1))


def over_ours(seconds: list[float], ours: list[float]) -> str:
    """A peer's step time over ours: the median of each step's ratio to ours in the same round, with the quartiles
    of those ratios, the noise a difference must exceed."""
    ratios = sorted(peer / mine for peer, mine in zip(seconds, ours, strict=True))
    return f"{ratios[len(ratios) // 2]:.2f} ({ratios[len(ratios) // 4]:.2f}-{ratios[3 * len(ratios) // 4]:.2f})"


def one_process_loss() -> tuple[float, int]:
    model, tokens = seeded_model(), global_batch()
    with torch.no_grad():
        logits = model(input_ids=tokens, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    return loss.item(), sum(p.numel() for p in model.parameters())
