"""Token-weighted metrics, reduced over the data-parallel ranks only.

A rank's mean is not the global mean when ranks hold different numbers of scored tokens (padding, uneven last
batches), so each metric keeps a sum and a token count and divides only after both are reduced. The reduction
group is the data-parallel one: tensor-parallel peers hold the same values and must not be counted twice.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric


class TokenMean(Metric):
    """``sum / tokens`` over every rank of the process group (all ranks by default)."""

    full_state_update = False
    higher_is_better = None

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("tokens", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, total: Tensor, tokens: Tensor) -> None:
        self.total += total.detach().to(self.total)
        self.tokens += tokens.detach().to(self.tokens)

    def compute(self) -> Tensor:
        return (self.total / self.tokens.clamp_min(1)).float()


class TokenPerplexity(TokenMean):
    """``exp`` of the token-mean loss: a perplexity of the global batch, not a mean of per-rank perplexities."""

    higher_is_better = False

    def compute(self) -> Tensor:
        return super().compute().exp()
