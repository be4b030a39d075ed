"""Whether a model class keeps the documents of a packed row apart by their restarting position ids.

transformers' mask functions read packed documents from ``position_ids`` when no attention mask is given (its own
attention on any device; FlashAttention's variable-length path on GPUs), but a model whose layers carry state along
the sequence (state-space and linear-attention mixers) or that builds its mask otherwise lets one document see the
one before. Found on a shrunk replica in this process, so that a data module packing documents is refused before any
collective rather than trained on what leaks between them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_automodel.hf.peft import unwrap_peft
from lightning_automodel.hf.replica import replica_problem
from lightning_automodel.hf.vision.mrope import is_mrope


def packed_documents_problem(model: nn.Module) -> str | None:
    """Why ``model`` would let the documents of a packed row see each other (None if it keeps them apart): a shrunk
    replica's logits on its two rows packed into one, position ids restarting, must equal its logits on each row."""
    hf_model = unwrap_peft(model)
    name = type(hf_model).__name__
    return replica_problem(
        hf_model,
        split_logits=_packed_logits,
        fails=f"{name} fails on packed documents",
        differs=f"{name} lets packed documents see each other",
        because="its layers carry state along the sequence, or it does not mask by position_ids",
    )


def _packed_logits(replica: nn.Module, tokens: Tensor) -> Tensor:
    """The replica's logits on its rows laid end to end in one row, position ids restarting at each, cut back. An
    M-RoPE model's come in four rows (:mod:`~lightning_automodel.hf.vision.mrope`), text tokens' all alike."""
    rows, length = tokens.shape
    positions = torch.arange(length).repeat(rows).unsqueeze(0)
    if is_mrope(replica.config):
        positions = positions.expand(4, 1, -1)
    logits = replica(input_ids=tokens.reshape(1, -1), position_ids=positions, use_cache=False).logits
    return logits.reshape(rows, length, -1)
