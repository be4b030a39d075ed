"""The models context parallel refuses, found without any collective: those it does not split, and classes whose
logits with their sequences split differ from their logits whole (checked on a shrunk replica)."""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from lightning_automodel.hf.replica import TOLERANCE, replica_problem, shrunk_replica
from lightning_automodel.hf.vision.image_inputs import IMAGE_START, image_inputs, image_token, image_token_count
from lightning_automodel.hf.vision.mrope import is_mrope, whole_row_positions
from lightning_automodel.parallel.context_parallel.attention import ATTENTION, text_model_only
from lightning_automodel.parallel.context_parallel.images import (
    IMAGE_INPUTS,
    TOKEN_INPUTS,
    held_image_arguments,
    token_blocks,
)
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
    problem = replica_problem(
        model,
        split_logits=_reordered_logits,
        fails=f"{name} fails with its sequences split,",
        differs=f"{name} computes other logits with its sequences split than whole",
        because="its attention does not run through transformers' attention functions (linear attention, state-space"
        " layers), or its positions are not read from position_ids",
        length=16,
    )
    return problem if problem is not None else _image_problem(model)


def _image_problem(model: nn.Module) -> str | None:
    """Why a vision-language ``model`` cannot split its sequences around images (None if it can, or takes none): a
    shrunk replica with an image a row, its placeholders straddling the cp=2 split, must compute the same logits
    split as whole (an image's tokens that see each other otherwise than causally, or both ways within the image as
    Gemma 3's, would not)."""
    name = type(model).__name__
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        replica, vocabulary = shrunk_replica(model)
        count = image_token_count(replica)
        if count is None:
            return None
        multiple = 2 * SIMULATED_CP
        inputs = image_inputs(replica, rows=2, tokens=-(-(IMAGE_START + count + multiple) // multiple) * multiple)
        placeholder = image_token(replica.config)
        text = torch.randint(0, vocabulary, inputs["input_ids"].shape)
        text[text == placeholder] = (placeholder + 1) % vocabulary
        inputs["input_ids"] = torch.where(inputs["input_ids"] == placeholder, placeholder, text)
        try:
            with torch.no_grad():
                expected = replica(**inputs, use_cache=False).logits
                tokens = inputs.pop("input_ids")
                actual = _reordered_logits(copy.deepcopy(replica), tokens, **inputs)
        except Exception as failure:  # noqa: BLE001 - the model's own code, whatever it raises, refuses the split
            return f"{name} fails with its sequences split around images on a shrunk replica ({failure})"
    error = ((actual - expected).abs().max() / expected.abs().max()).item()
    if not error < TOLERANCE:  # NaN included
        return (
            f"{name} computes other logits with its sequences split around images than whole (relative error"
            f" {error:.2g} on a shrunk replica): its image tokens see each other otherwise than causally, or than"
            " both ways within an image (Gemma 3)"
        )
    return None


def _reordered_logits(replica: nn.Module, tokens: Tensor, **inputs: Tensor) -> Tensor:
    """The replica's logits, through the attention here, on its tokens reordered as cp ranks hold them (all of them
    one rank's queries and keys, so no collective), put back in order; ``inputs``: its images and their tokens'
    types (see :mod:`.images`)."""
    rows, length = tokens.shape
    order = torch.cat([token_indices(length, SIMULATED_CP, rank) for rank in range(SIMULATED_CP)])
    images = {name: value for name, value in inputs.items() if name in IMAGE_INPUTS}
    types = {name: value for name, value in inputs.items() if name in TOKEN_INPUTS}
    positions = torch.arange(length).expand(rows, -1)
    if images and is_mrope(replica.config):
        positions = whole_row_positions(replica, tokens, images=images, tokens=types)
    blocks = token_blocks(types, images=images)
    blocks = blocks[:, order] if blocks is not None else None
    split = SequenceSplit(
        query_index=order,
        key_index=order,
        query_document=torch.ones(rows, length, dtype=torch.long),
        key_document=torch.ones(rows, length, dtype=torch.long),
        query_visible=torch.ones(rows, length, dtype=torch.bool),
        key_visible=torch.ones(rows, length, dtype=torch.bool),
        group=None,
        query_block=blocks,
        key_block=blocks,
    )
    replica.set_attn_implementation(text_model_only(replica, ATTENTION))
    if images:
        inputs |= held_image_arguments(replica, images, input_ids=tokens, index=order, group=None, rank=0, cp=1)
    reordered = replica(
        input_ids=tokens[:, order],
        position_ids=positions[..., order],
        **{name: value[:, order] for name, value in types.items()},
        **{name: value for name, value in inputs.items() if name not in (*IMAGE_INPUTS, *TOKEN_INPUTS)},
        sequence_split=split,
        use_cache=False,
    ).logits
    logits = torch.empty_like(reordered)
    logits[:, order] = reordered
    return logits
