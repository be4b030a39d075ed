"""The models context parallel refuses, found without any collective: those it does not split, and classes whose
logits with their sequences split differ from their logits whole (checked on a shrunk replica)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from lightning_automodel.hf.replica import replica_problem
from lightning_automodel.parallel.context_parallel.attention import ATTENTION
from lightning_automodel.parallel.context_parallel.sequence_split import SequenceSplit, token_indices
from lightning_automodel.parallel.experts.load_balancing_loss import balancing_problem

SIMULATED_CP = 2  # the split the replica's tokens are reordered by


def context_parallel_problem(model: nn.Module) -> str | None:
    """Why ``model`` cannot split its sequences over cp ranks (None if it can), found without any collective: a
    shrunk replica of it (random weights, in this process) must compute the same logits on its tokens in the order
    of a cp=2 split, through the attention here, as whole. A model whose attention does not run through
    transformers' attention functions (linear attention, state-space layers) or that derives positions from where
    a token sits rather than from ``position_ids`` computes others, and is refused."""
    name = type(model).__name__
    if not isinstance(model, PreTrainedModel):
        return f"{name} is not a Hugging Face model; context parallel splits those only"
    if getattr(model.config, "is_encoder_decoder", False):
        return f"{name} is an encoder-decoder model; context parallel splits decoder-only models"
    if (problem := balancing_problem(model)) is not None:
        return problem
    return replica_problem(
        model,
        split_logits=_reordered_logits,
        fails=f"{name} fails with its sequences split,",
        differs=f"{name} computes other logits with its sequences split than whole",
        because="its attention does not run through transformers' attention functions (linear attention, state-space"
        " layers), or its positions are not read from position_ids",
        length=16,
    )


def _reordered_logits(replica: nn.Module, tokens: Tensor) -> Tensor:
    """The replica's logits, through the attention here, on its tokens reordered as cp ranks hold them (all of them
    one rank's queries and keys, so no collective), put back in order."""
    rows, length = tokens.shape
    order = torch.cat([token_indices(length, SIMULATED_CP, rank) for rank in range(SIMULATED_CP)])
    split = SequenceSplit(
        query_index=order,
        key_index=order,
        query_document=torch.ones(rows, length, dtype=torch.long),
        key_document=torch.ones(rows, length, dtype=torch.long),
        query_visible=torch.ones(rows, length, dtype=torch.bool),
        key_visible=torch.ones(rows, length, dtype=torch.bool),
        group=None,
    )
    positions = torch.arange(length).expand(rows, -1)
    replica.set_attn_implementation(ATTENTION)
    reordered = replica(
        input_ids=tokens[:, order], position_ids=positions[:, order], sequence_split=split, use_cache=False
    ).logits
    logits = torch.empty_like(reordered)
    logits[:, order] = reordered
    return logits
