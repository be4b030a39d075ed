"""The auxiliary load-balancing loss of mixture-of-experts models over the global batch, and the experts' load: the
mean of per-rank losses is not the loss of the global batch (the mean of products is not the product of means).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_autograd
from torch import Tensor
from torch.distributed import ProcessGroup


@dataclass
class ExpertLoad:
    """How the tokens of the global batch were routed: top-k assignments per layer and expert (mask-weighted)."""

    assignments: Tensor  # (layers, experts)

    def imbalance(self) -> Tensor:
        """Per layer, the busiest expert's assignments over the mean expert's: 1 is perfectly balanced."""
        return self.assignments.max(dim=-1).values / self.assignments.mean(dim=-1).clamp_min(1e-12)


def load_balancing_loss(
    router_logits: Sequence[Tensor],
    *,
    num_experts: int,
    top_k: int,
    attention_mask: Tensor | None = None,
    group: ProcessGroup | None = None,
) -> tuple[Tensor, ExpertLoad]:
    """The load-balancing loss of the tokens whose router logits (one (tokens, experts) tensor per layer) all ranks
    of ``group`` hold together, as transformers computes it for one batch in one process; padding (``attention_mask``
    zero) left out. Without ``group``, of this rank's tokens alone.

    Switch Transformer's loss, as transformers adds it under ``output_router_logits``: per expert, the share of the
    top-k assignments it got times its mean routing probability, summed over experts, times their number. Each rank
    sums its tokens' assignments and probabilities per layer and expert, and the sums are added over ``group`` (one
    all-reduce each). Gradient: the sum's backward adds every rank's gradient of the shared loss, ``dp`` times the
    derivative through the rank's own tokens; FSDP then averages over those ranks, as it does for
    :func:`~lightning_automodel.parallel.loss.global_token_mean`'s share of the language-model loss.
    """
    first = router_logits[0]
    rows = (
        torch.ones(first.shape[0], device=first.device)
        if attention_mask is None
        else attention_mask.reshape(-1).to(device=first.device, dtype=torch.float32)
    )
    assignments, probabilities = [], []
    for logits in router_logits:
        routing = torch.softmax(logits, dim=-1)
        selected = torch.topk(routing, top_k, dim=-1).indices
        counts = torch.zeros(num_experts, device=first.device)
        assignments.append(counts.scatter_add(0, selected.reshape(-1), rows.repeat_interleave(top_k)))
        probabilities.append((routing.float() * rows.unsqueeze(-1)).sum(dim=0))
    counts, probability_sums = torch.stack(assignments), torch.stack(probabilities)
    tokens = rows.sum().reshape(1) * len(router_logits)
    if group is not None and dist.get_world_size(group) > 1:
        totals = torch.cat([counts.flatten(), tokens])
        dist.all_reduce(totals, group=group)
        counts, tokens = totals[:-1].view_as(counts), totals[-1:]
        probability_sums = dist_autograd.all_reduce(probability_sums, group=group)
    share_of_assignments = counts.sum(dim=0) / tokens
    mean_probability = probability_sums.sum(dim=0) / tokens
    return (share_of_assignments * mean_probability).sum() * num_experts, ExpertLoad(counts)
