"""The next-token loss a sequence chunk at a time: a training step that never holds the whole logits ([rows, tokens,
vocabulary / tp] in fp32, and in backward their log-softmax and gradient: often a step's largest tensors). Forward runs
each chunk's head, cross-entropy and their backward at once, keeping the chunk's summed loss and the gradients of it
(torchtitan's chunked loss does the same); nothing is recomputed."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_automodel.hf.peft import unwrap_peft
from lightning_automodel.hf.replica import replica_problem
from lightning_automodel.parallel.context_parallel import context_parallel_of
from lightning_automodel.parallel.fsdp.sharding import view_outputs_allowed
from lightning_automodel.parallel.loss import next_token_targets, token_hits, token_loss_sum
from lightning_automodel.parallel.pipeline import pipeline_of

SPLIT_CALLS = (
    "under pipeline or context parallel (pp > 1, cp > 1) the model's call computes the loss (the last stage a"
    " micro-batch at a time; each rank its share of the sequence), not chunked yet"
)


def check_loss_chunks(loss_chunks: int) -> None:
    """``loss_chunks`` (how many sequence chunks the head and loss run in) is a positive integer."""
    if isinstance(loss_chunks, bool) or not isinstance(loss_chunks, int) or loss_chunks < 1:
        raise ValueError(f"loss_chunks={loss_chunks!r} must be a positive integer (1: the logits whole).")


def chunked_causal_lm_loss_sum(
    model: nn.Module,
    *,
    input_ids: Tensor,
    labels: Tensor,
    chunks: int,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    ignore_index: int = -100,
) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's summed next-token cross-entropy, how many tokens it sums and how many of them the logits rank
    first: :func:`~lightning_automodel.parallel.loss.causal_lm_loss_sum` and ``next_token_hits`` of ``model``'s
    logits, computed ``chunks`` sequence chunks at a time. ``model``: a Hugging Face causal LM (or a PEFT model of
    one) that :func:`chunking_problem` accepts; under tensor parallel, call it inside ``loss_parallel`` as the whole
    logits' loss. The gradients computed in forward are those of a loss whose gradient is 1 over the rank's positions;
    backward scales them by the gradient the loss gets (:class:`_PrecomputedBackward`), so that a loss scaled after
    this one (gradient accumulation) scales the head's gradients with the decoder's."""
    hf_model = unwrap_peft(model)
    hidden = _replicated_or_evenly_sharded(
        last_hidden_states(hf_model, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    )
    targets = next_token_targets(labels, ignore_index=ignore_index)
    if hidden.size(1) != targets.size(1):
        raise ValueError(
            f"The last hidden states hold {hidden.size(1)} of the sequence's {targets.size(1)} positions (a"
            " tensor-parallel plan leaving them a local sequence shard): chunks would pair them with other positions'"
            " labels. Give the final norm a style whose output is a DTensor (use_local_output=False), or loss_chunks=1."
        )
    head, pairs = hf_model.get_output_embeddings(), _chunks(hidden, targets=targets, chunks=chunks)
    tokens = (targets != ignore_index).sum()
    weights = [weight for weight in head.parameters() if weight.requires_grad]
    if not torch.is_grad_enabled() or not (hidden.requires_grad or weights):
        losses, hits = zip(
            *(_chunk_loss(head, hidden=h, targets=t, ignore_index=ignore_index) for h, t in pairs), strict=True
        )
        return _total(losses), tokens, _total(hits)
    if not hidden.requires_grad and isinstance(hf_model, FSDPModule):
        raise ValueError(
            f"loss_chunks={chunks} with lm_head the only trained part of {_class_name(hf_model)}: FSDP2 reduces"
            " the head's gradients once backward reaches the hidden states, which here need none. Use loss_chunks=1."
        )
    scale = float(targets.numel())  # the gradients are computed for the loss over this rank's positions: mean-sized
    loss_sum, hits, gradients = _forward_and_backward(
        head, pairs=pairs, weights=weights, hidden=hidden, scale=scale, ignore_index=ignore_index
    )
    return _PrecomputedBackward.apply(loss_sum, gradients, scale, hidden, *weights), tokens, hits


def _class_name(model: nn.Module) -> str:
    """``model``'s class name, not the one FSDP2 derives from it."""
    return next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule)).__name__


def _forward_and_backward(
    head: nn.Module,
    *,
    pairs: list[tuple[Tensor, Tensor]],
    weights: list[Tensor],
    hidden: Tensor,
    scale: float,
    ignore_index: int,
) -> tuple[Tensor, Tensor, list[Tensor | None]]:
    """The summed loss and hits of ``head`` on the (hidden states, targets) chunks ``pairs``, and the gradients of the
    sum over ``scale`` with respect to ``hidden`` (None where it needs none) and to the head's ``weights``: each chunk's
    backward runs before the next chunk's forward, so that one chunk's logits are alive at a time. Divided, the
    gradients keep a mean's magnitude, which fp16 holds where a sum's may overflow. The weights' gradients are summed
    over the chunks in their own dtype, as torchtitan's are (no fp32 copy of the head: for bf16 weights the head's
    gradient then errs by 8.0e-3 at 16 chunks, 6.2e-3 whole, against fp32; fp16: 1.2e-3 and 0.9e-3)."""
    losses, hits, hidden_grads, weight_grads = [], [], [], None
    for hidden_chunk, target_chunk in pairs:
        leaf = hidden_chunk.detach().requires_grad_(hidden.requires_grad)
        # The head reads a view of the leaf: torch's module trackers (MemTracker's, FlopCounterMode's) hook a module's
        # inputs with a hook that autograd.grad refuses on a leaf.
        loss, chunk_hits = _chunk_loss(head, hidden=leaf.view_as(leaf), targets=target_chunk, ignore_index=ignore_index)
        grads = torch.autograd.grad(loss / scale, [leaf, *weights] if hidden.requires_grad else weights)
        if hidden.requires_grad:
            hidden_grads.append(grads[0])
            grads = grads[1:]
        if weight_grads is None:
            weight_grads = list(grads)
        else:
            for total, grad in zip(weight_grads, grads, strict=True):
                total.add_(grad)
        losses.append(loss.detach())
        hits.append(chunk_hits)
    hidden_grad = _joined_like(hidden_grads, like=hidden) if hidden.requires_grad else None
    return _total(losses), _total(hits), [hidden_grad, *(weight_grads or [])]


def _chunk_loss(head: nn.Module, *, hidden: Tensor, targets: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    """One chunk's summed loss and hits."""
    logits = head(hidden)
    hits, _ = token_hits(logits.detach(), targets, ignore_index=ignore_index)
    return token_loss_sum(logits, targets, ignore_index=ignore_index)[0], hits


def _total(values: list[Tensor] | tuple[Tensor, ...]) -> Tensor:
    """The sum of ``values``, a tensor (as their type: a DTensor under tp)."""
    return sum(values[1:], values[0])


def _replicated_or_evenly_sharded(hidden: Tensor) -> Tensor:
    """The hidden states, replicated over the tp ranks unless sequence parallel left each rank an equal share of the
    sequence (a DTensor sharded along it alone): those stay as they are, and :func:`_chunks` cuts each share."""
    if not isinstance(hidden, DTensor) or all(placement.is_replicate() for placement in hidden.placements):
        return hidden
    if hidden.placements == (Shard(1),) and hidden.size(1) % hidden.device_mesh.size() == 0:
        return hidden
    return hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim)


def _chunks(hidden: Tensor, *, targets: Tensor, chunks: int) -> list[tuple[Tensor, Tensor]]:
    """(hidden states, targets) ``chunks`` times, each chunk the same slice of every rank's share of the sequence
    (the whole sequence unless sequence parallel splits it), detached: under sequence parallel the head then gathers
    each chunk as it gathers the whole, and reduce-scatters its gradient, without another collective. A chunk's
    positions are thereby not contiguous; the summed loss and hits do not depend on their order."""
    local = hidden.to_local() if isinstance(hidden, DTensor) else hidden
    shares, size = targets.size(1) // local.size(1), -(-local.size(1) // chunks)
    target_chunks = [share.flatten(1, 2) for share in targets.unflatten(1, (shares, -1)).split(size, dim=2)]
    hidden_chunks = [_placed_like(chunk, like=hidden) for chunk in local.detach().split(size, dim=1)]
    return list(zip(hidden_chunks, target_chunks, strict=True))


def _placed_like(local: Tensor, *, like: Tensor) -> Tensor:
    """``local`` in ``like``'s placements (as it is, unless ``like`` is a DTensor)."""
    if not isinstance(like, DTensor):
        return local
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False)


def _joined_like(chunks: list[Tensor], *, like: Tensor) -> Tensor:
    """The hidden chunks' gradients put back together as :func:`_chunks` cut ``like``, in its placements."""
    if not isinstance(like, DTensor):
        return torch.cat(chunks, dim=1)
    local = torch.cat([chunk.redistribute(placements=like.placements).to_local() for chunk in chunks], dim=1)
    return DTensor.from_local(local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride())


def last_hidden_states(model: nn.Module, **inputs: Tensor | None) -> Tensor:
    """What the model's head reads: its own call (FSDP2's hooks and all) with the head an identity for the call.

    The model's call, not its base model's, so that the FSDP2 unit around the whole model gathers the embedding, the
    final norm and the head, and reduces their gradients, as for the whole logits; the head's weights are then held
    gathered (``unshard``: a no-op unless the unit reshards after forward) for the chunks and until backward, which
    accumulates the head's gradients into them."""
    head = model.get_output_embeddings()
    model.set_output_embeddings(nn.Identity())
    try:
        with view_outputs_allowed():  # the identity returns a slice of the hidden states; nothing writes to it
            hidden = model(**inputs, use_cache=False).logits
    finally:
        model.set_output_embeddings(head)
    if isinstance(model, FSDPModule):
        model.unshard()
    return hidden


class _PrecomputedBackward(torch.autograd.Function):
    """A loss whose gradients with respect to its inputs were computed with it, for a loss gradient of 1 / ``scale``:
    backward scales them by the loss's actual gradient times ``scale`` (exact, as they are linear in it)."""

    @staticmethod
    def forward(ctx, loss: Tensor, gradients: list[Tensor], scale: float, *inputs: Tensor) -> Tensor:  # noqa: ARG004
        ctx.gradients, ctx.scale = gradients, scale  # ``inputs``: what autograd passes the gradients to
        return loss.clone()

    @staticmethod
    def backward(ctx, loss_grad: Tensor) -> tuple[Tensor | None, ...]:
        if ctx.gradients is None or torch.is_grad_enabled():
            raise RuntimeError(
                "A second backward through a chunked loss (retain_graph=True), or one building a graph of its own"
                " (create_graph=True): its gradients were computed in forward, once. Use loss_chunks=1."
            )
        gradients, ctx.gradients = ctx.gradients, None  # freed now, not when the loss tensor is
        return None, None, None, *(_scaled(gradient, loss_grad * ctx.scale) for gradient in gradients)


def _scaled(gradient: Tensor | None, factor: Tensor) -> Tensor | None:
    """``gradient`` times the scalar ``factor``, either a DTensor where the other is not (tp without sp: the hidden
    states are plain, the head's weights and the loss DTensors)."""
    if gradient is None:
        return None
    if isinstance(factor, DTensor) and not isinstance(gradient, DTensor):
        factor = factor.full_tensor()
    elif isinstance(gradient, DTensor) and not isinstance(factor, DTensor):
        factor = DTensor.from_local(factor, gradient.device_mesh, [Replicate()] * gradient.device_mesh.ndim)
    return gradient * factor


def chunking_problem(model: nn.Module) -> str | None:
    """Why ``model``'s loss cannot be chunked, or None: its logits must be its output embedding applied to its last
    hidden states (checked on a shrunk replica, in this process: a scale after a linear head, Granite's
    ``logits_scaling``, passes, as it scales the hidden states instead; soft-capping does not), no auxiliary loss may
    ride on its call (a mixture of experts' router loss), and its call must not compute the loss itself (pipeline and
    context parallel). The same on every rank."""
    hf_model = unwrap_peft(model)
    name, text_config = _class_name(hf_model), hf_model.config.get_text_config()
    if pipeline_of(model) is not None or context_parallel_of(model) is not None:
        return SPLIT_CALLS
    if getattr(text_config, "final_logit_softcapping", None):
        return f"{name} soft-caps its logits after its lm_head (final_logit_softcapping)"
    if getattr(text_config, "output_router_logits", False):
        return f"{name} adds its router's auxiliary loss in its own call: set output_router_logits=False"
    if hf_model.get_output_embeddings() is None:
        return f"{name} has no output embedding (lm_head) to run a chunk at a time"
    return replica_problem(
        hf_model,
        split_logits=_head_of_hidden_states,
        fails=f"{name} fails",
        differs=f"{name}'s logits are more than its lm_head on its last hidden states",
    )


def _head_of_hidden_states(replica: nn.Module, tokens: Tensor) -> Tensor:
    """The replica's output embedding on its last hidden states."""
    return replica.get_output_embeddings()(last_hidden_states(replica, input_ids=tokens))
