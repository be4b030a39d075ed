"""The auxiliary load-balancing loss of mixture-of-experts models over the global batch, and the experts' load: the
mean of per-rank losses is not the loss of the global batch (the mean of products is not the product of means).

Switch Transformer's loss, as transformers adds it under ``output_router_logits``: per expert, the share of the top-k
assignments it got times its mean routing probability, summed over experts, times their number; shares and means over
every token and every layer. Each holder of tokens or layers (data-parallel and cp ranks, pipeline stages,
micro-batches) sums its tokens' assignments and probabilities (:func:`router_statistics`); the loss is made of the
totals (:func:`balancing_loss`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_autograd
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from transformers import PreTrainedModel

from lightning_automodel.hf.replica import shrunk_replica


@dataclass
class ExpertLoad:
    """How the tokens of the global batch were routed: top-k assignments per layer and expert (mask-weighted)."""

    assignments: Tensor  # (layers, experts)

    def imbalance(self) -> Tensor:
        """Per layer, the busiest expert's assignments over the mean expert's: 1 is perfectly balanced."""
        return self.assignments.max(dim=-1).values / self.assignments.mean(dim=-1).clamp_min(1e-12)


@dataclass(frozen=True)
class Balancing:
    """What a model's load-balancing loss needs: its experts, how many each token picks, and the loss's weight."""

    num_experts: int
    top_k: int
    weight: float  # transformers' router_aux_loss_coef


def adds_balancing_loss(model: nn.Module) -> bool:
    """Whether ``model`` adds a router's auxiliary loss to its own (transformers' ``output_router_logits``)."""
    return bool(getattr(getattr(model, "config", None), "output_router_logits", False))


def balancing_of(model: nn.Module) -> Balancing | None:
    """The load-balancing settings of a Hugging Face model adding the loss to its own, as transformers' classes keep
    them; None for any other (:func:`balancing_problem` refuses one adding a loss of other settings)."""
    names = ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")
    if not adds_balancing_loss(model) or not all(hasattr(model, name) for name in names):
        return None
    return Balancing(*(getattr(model, name) for name in names))


@dataclass
class RouterStatistics:
    """One holder's share of the loss's totals: top-k assignments (no gradient) and routing probabilities summed over
    its tokens, per layer and expert, and how many token-layers it counted."""

    assignments: Tensor  # (layers, experts)
    probabilities: Tensor  # (layers, experts), with its gradient
    token_layers: Tensor  # (1,)


def router_statistics(
    router_logits: Sequence[Tensor], *, num_experts: int, top_k: int, token_mask: Tensor | None = None
) -> RouterStatistics:
    """The statistics of router logits (one (tokens, experts) tensor per layer) over the tokens ``token_mask`` keeps
    (a mask of the rows' tokens, flattened as the logits are; None: all)."""
    first = router_logits[0]
    if token_mask is None:
        weights = torch.ones(first.shape[0], device=first.device)
    else:
        weights = token_mask.reshape(-1).to(device=first.device, dtype=torch.float32)
    assignments, probabilities = [], []
    for logits in router_logits:
        routing = torch.softmax(logits, dim=-1)
        selected = torch.topk(routing, top_k, dim=-1).indices
        counts = torch.zeros(num_experts, device=first.device)
        assignments.append(counts.scatter_add(0, selected.reshape(-1), weights.repeat_interleave(top_k)))
        probabilities.append((routing.float() * weights.unsqueeze(-1)).sum(dim=0))
    token_layers = weights.sum().reshape(1) * len(router_logits)
    return RouterStatistics(torch.stack(assignments).detach(), torch.stack(probabilities), token_layers.detach())


def balancing_loss(assignments: Tensor, probabilities: Tensor, token_layers: Tensor, *, num_experts: int) -> Tensor:
    """The loss from totals over every token and layer: ``assignments`` and ``probabilities`` per expert (or per layer
    and expert, summed here), ``token_layers`` counted."""
    if assignments.ndim == 2:
        assignments, probabilities = assignments.sum(0), probabilities.sum(0)
    return (assignments / token_layers * probabilities / token_layers).sum() * num_experts


def load_balancing_loss(
    router_logits: Sequence[Tensor],
    *,
    num_experts: int,
    top_k: int,
    attention_mask: Tensor | None = None,
    group: ProcessGroup | None = None,
) -> tuple[Tensor, ExpertLoad]:
    """The load-balancing loss of the tokens whose router logits all ranks of ``group`` hold together, as
    transformers computes it for one batch in one process; padding (``attention_mask`` zero) left out. Without
    ``group``, of this rank's tokens alone.

    The statistics are added over ``group`` (one all-reduce each). Gradient: the sum's backward adds every rank's
    gradient of the shared loss, ``dp`` times the derivative through the rank's own tokens; FSDP then averages over
    those ranks, as it does for :func:`~lightning_automodel.parallel.loss.global_token_mean`'s share of the
    language-model loss.
    """
    statistics = router_statistics(router_logits, num_experts=num_experts, top_k=top_k, token_mask=attention_mask)
    counts, probabilities, tokens = statistics.assignments, statistics.probabilities, statistics.token_layers
    if group is not None and dist.get_world_size(group) > 1:
        totals = torch.cat([counts.flatten(), tokens])
        dist.all_reduce(totals, group=group)
        counts, tokens = totals[:-1].view_as(counts), totals[-1:]
        probabilities = dist_autograd.all_reduce(probabilities, group=group)
    return balancing_loss(counts, probabilities, tokens, num_experts=num_experts), ExpertLoad(counts)


def balancing_problem(model: nn.Module) -> str | None:
    """Why a model adding a load-balancing loss cannot have it computed over the global batch here (None if it can):
    its shrunk replica's own auxiliary loss must be :func:`load_balancing_loss` of the router logits it returns, on a
    batch with padding."""
    if not adds_balancing_loss(model) or not isinstance(model, PreTrainedModel):
        return None
    name = type(model).__name__
    if balancing_of(model) is None:
        return (
            f"{name} adds an auxiliary loss without transformers' load-balancing settings (num_experts,"
            " num_experts_per_tok, router_aux_loss_coef), which this cannot compute over the global batch: set"
            " output_router_logits=False"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        replica, vocabulary = shrunk_replica(model)
        tokens = torch.randint(0, vocabulary, (2, 8))
    mask = torch.ones_like(tokens)
    mask[1, -3:] = 0
    try:
        with torch.no_grad():
            outputs = replica(input_ids=tokens, attention_mask=mask, use_cache=False)
        replica_balancing = balancing_of(replica)
        own, _ = load_balancing_loss(
            outputs.router_logits,
            num_experts=replica_balancing.num_experts,
            top_k=replica_balancing.top_k,
            attention_mask=mask,
        )
    except Exception as failure:  # noqa: BLE001 - the model's own code, whatever it raises
        return (
            f"{name}'s load-balancing loss could not be checked on a shrunk replica ({type(failure).__name__}:"
            f" {failure})"
        )
    if outputs.aux_loss is None or not torch.allclose(own, outputs.aux_loss.float(), rtol=1e-5, atol=1e-7):
        return (
            f"{name}'s auxiliary loss is not the load-balancing loss computed here over the global batch (on a shrunk"
            " replica): set output_router_logits=False"
        )
    return None
