"""The loss of a schedule step: each micro-batch's on the last stage, summed and divided by the global batch's token
count (micro-batches x dp ranks, cp ranks included), as in one process."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from lightning_automodel.parallel.loss import next_token_hits, next_token_targets, token_hits, token_loss_sum


class StepLoss:
    """The schedule's loss function for one step at a time, and the step's totals. ``loss_fn``: a loss of one's own
    (``f(logits, labels)``, summed over a micro-batch's tokens), else next-token cross-entropy; ``group``: the ranks
    whose batches make the global batch (dp x cp)."""

    def __init__(self, loss_fn: Callable[[Tensor, Tensor], Tensor] | None, *, group: ProcessGroup) -> None:
        self.loss_fn = loss_fn
        self.group = group
        self._scale = torch.tensor(1.0)
        self._totals: list[Tensor] = []

    def start(self, targets: Tensor) -> None:
        """A step over a batch of ``targets`` (shifted labels): its global token scale, dp / the global batch's scored
        tokens. A micro-batch's summed loss times it is its share of the global token mean, which FSDP's mean over the
        dp ranks turns into the single-process gradient."""
        tokens = (targets != -100).sum().float()
        dist.all_reduce(tokens, group=self.group)
        self._scale = dist.get_world_size(self.group) / tokens.clamp_min(1)
        self._totals = []

    def scaled(self, loss_sum: Tensor) -> Tensor:
        return loss_sum * self._scale

    def __call__(self, logits: Tensor, target: Tensor) -> Tensor:
        """A micro-batch's share of the global token mean, from its shifted targets (or its labels, for a loss of
        one's own); its summed loss, tokens and next-token hits are kept."""
        if self.loss_fn is None:
            loss_sum, tokens = token_loss_sum(logits, target)
            hits, _ = token_hits(logits, target)
        else:
            loss_sum, tokens = self.loss_fn(logits, target), (next_token_targets(target) != -100).sum()
            hits, _ = next_token_hits(logits, target)
        local = loss_sum.to_local() if isinstance(loss_sum, DTensor) else loss_sum
        self._totals.append(torch.stack([local.detach(), tokens.float(), hits.float()]))
        return self.scaled(loss_sum)

    def totals(self, microbatches: int) -> Tensor:
        """The last stage's summed loss, scored tokens and next-token hits of the step. Those of the micro-batches
        only: at its first step a schedule infers the stages' shapes by running the stages and the loss once more,
        before them."""
        return torch.stack(self._totals[-microbatches:]).sum(0)
