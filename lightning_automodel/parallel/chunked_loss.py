"""The next-token loss a sequence chunk at a time: a training step that never holds the whole logits.

The logits a loss reads ([rows, tokens, vocabulary / tp], in fp32), and in backward their log-softmax and gradient, are
the largest tensors of many steps: a 128k vocabulary at a few thousand tokens a row outweighs a decoder layer's saved
activations. Here the base model's last hidden states are split along the sequence, and each chunk runs the head and
the cross-entropy under activation checkpointing: forward keeps the chunk's summed loss and nothing of its logits;
backward recomputes one chunk's logits at a time. The price is one more forward of the head (2 x rows x tokens x
hidden x vocabulary / tp FLOPs a step). torchtitan's chunked loss runs each chunk's backward inside forward instead,
which saves the recomputation but fixes the loss's gradient at 1: a loss scaled after it (Lightning divides it under
gradient accumulation) would scale the decoder's gradients and not the head's.

The head is the model's output embedding on the last hidden states, read from the model's own call with its head an
identity (:func:`last_hidden_states`): a scale the call applies after a linear head (Granite's ``logits_scaling``)
then scales the hidden states instead, to the same logits. A class whose logits are more than that (soft-capping) is
refused: :func:`chunking_problem` compares both on a shrunk replica of it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

from lightning_automodel.parallel.context_parallel import context_parallel_of
from lightning_automodel.parallel.loss import next_token_targets, token_hits, token_loss_sum
from lightning_automodel.parallel.pipeline import pipeline_of

SPLIT_CALLS = (
    "under pipeline or context parallel (pp > 1, cp > 1) the model's call computes the loss (the last stage a"
    " micro-batch at a time; each rank its share of the sequence), not chunked yet"
)


def chunked_causal_lm_loss_sum(
    model: nn.Module,
    *,
    input_ids: Tensor,
    labels: Tensor,
    chunks: int,
    attention_mask: Tensor | None = None,
    ignore_index: int = -100,
) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's summed next-token cross-entropy, how many tokens it sums and how many of them the logits rank
    first: :func:`~lightning_automodel.parallel.loss.causal_lm_loss_sum` and ``next_token_hits`` of ``model``'s
    logits, computed ``chunks`` sequence chunks at a time (see the module's docstring). ``model``: a Hugging Face
    causal LM (or a PEFT model of one) that :func:`chunking_problem` accepts; under tensor parallel, call it inside
    ``loss_parallel`` as the whole logits' loss."""
    hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = _whole_sequence(last_hidden_states(hf_model, input_ids=input_ids, attention_mask=attention_mask))
    targets = next_token_targets(labels, ignore_index=ignore_index)
    if hidden.size(1) != targets.size(1):
        raise ValueError(
            f"The last hidden states hold {hidden.size(1)} of the sequence's {targets.size(1)} positions (a"
            " tensor-parallel plan leaving them a local sequence shard): chunks would pair them with other positions'"
            " labels. Give the final norm a style whose output is a DTensor (use_local_output=False), or loss_chunks=1."
        )
    size, head = -(-hidden.size(1) // chunks), hf_model.get_output_embeddings()
    losses, hits = [], []
    for hidden_chunk, target_chunk in zip(hidden.split(size, dim=1), targets.split(size, dim=1), strict=True):
        chunk = _ChunkLoss(head, target_chunk, ignore_index)
        losses.append(checkpoint(chunk, hidden_chunk, use_reentrant=False))
        hits.append(chunk.hits)
    return sum(losses[1:], losses[0]), (targets != ignore_index).sum(), sum(hits[1:], hits[0])


def last_hidden_states(model: nn.Module, **inputs: Tensor | None) -> Tensor:
    """What the model's head reads: its own call (FSDP2's hooks and all) with the head an identity for the call.

    The model's call, not its base model's, so that the FSDP2 unit around the whole model gathers the embedding, the
    final norm and the head, and reduces their gradients, as for the whole logits; the head's weights are then held
    gathered until backward (``unshard``: a no-op unless the unit reshards after forward), where each chunk
    recomputes its logits with them."""
    head = model.get_output_embeddings()
    model.set_output_embeddings(nn.Identity())
    try:
        hidden = model(**inputs, use_cache=False).logits
    finally:
        model.set_output_embeddings(head)
    if isinstance(model, FSDPModule):
        model.unshard()
    return hidden


class _ChunkLoss:
    """One chunk's head and summed loss; its hits (counted at the first call: not again when backward recomputes
    the chunk, as counting gathers over the tp ranks)."""

    def __init__(self, head: nn.Module, targets: Tensor, ignore_index: int) -> None:
        self.head, self.targets, self.ignore_index = head, targets, ignore_index
        self.hits: Tensor | None = None

    def __call__(self, hidden: Tensor) -> Tensor:
        logits = self.head(hidden)
        if self.hits is None:
            self.hits, _ = token_hits(logits.detach(), self.targets, ignore_index=self.ignore_index)
        return token_loss_sum(logits, self.targets, ignore_index=self.ignore_index)[0]


def _whole_sequence(hidden: Tensor) -> Tensor:
    """The hidden states with the whole sequence on every tp rank (gathered once, as the head would gather them
    anyway): sequence parallel leaves them sharded along it, and chunks must be slices of the same positions."""
    if isinstance(hidden, DTensor) and any(not p.is_replicate() for p in hidden.placements):
        return hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim)
    return hidden


def _head_error(model: nn.Module) -> float:
    """The largest difference between a shrunk replica's logits and its head on its last hidden states, relative to
    the largest logit."""
    from lightning_automodel.hf.shrink import shrunk_config

    config = shrunk_config(model.config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        replica = type(model)(config).eval()
        tokens = torch.randint(0, config.get_text_config().vocab_size, (2, 8))
    with torch.no_grad():
        expected = replica(input_ids=tokens, use_cache=False).logits
        actual = replica.get_output_embeddings()(last_hidden_states(replica, input_ids=tokens))
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def chunking_problem(model: nn.Module) -> str | None:
    """Why ``model``'s loss cannot be chunked, or None: its logits must be its output embedding applied to its last
    hidden states (checked on a shrunk replica, in this process), no auxiliary loss may ride on its call
    (a mixture of experts' router loss), and its call must not compute the loss itself (pipeline and context
    parallel). The same on every rank."""
    hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model
    name, text_config = type(hf_model).__name__, hf_model.config.get_text_config()
    if pipeline_of(model) is not None or context_parallel_of(model) is not None:
        return SPLIT_CALLS
    if getattr(text_config, "final_logit_softcapping", None):
        return f"{name} soft-caps its logits after its lm_head (final_logit_softcapping)"
    if getattr(text_config, "output_router_logits", False):
        return f"{name} adds its router's auxiliary loss in its own call: set output_router_logits=False"
    if hf_model.get_output_embeddings() is None:
        return f"{name} has no output embedding (lm_head) to run a chunk at a time"
    try:
        error = _head_error(hf_model)
    except Exception as failure:  # noqa: BLE001 - the model's own code, whatever it raises, refuses chunking
        return f"{name} fails on a shrunk replica ({type(failure).__name__}: {failure})"
    if not error < 1e-5:
        return (
            f"{name}'s logits are more than its lm_head on its last hidden states (relative error {error:.2g} on a"
            " shrunk replica)"
        )
    return None
