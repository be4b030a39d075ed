"""The load-balancing loss of a pipelined mixture-of-experts model, over every layer and every token of the global
batch, with one process's value and gradient.

The loss is a product of totals over all layers (on every stage) and tokens (in every micro-batch, on every
data-parallel and cp rank): a layer's routing probabilities get the gradient weight x experts x each expert's global
assignments / token-layers², known only once every layer has routed every token, while a schedule runs a
micro-batch's backward before the last one's forward. So a training step routes first: a forward-only pass of the
schedule, without gradients and with the random state then restored, counts the assignments. The training pass then
adds each stage's share of the gradient in its backward, with that coefficient (as Megatron's MoEAuxLossAutoScaler adds
a scaled loss's gradient), and checks that it routed as counted (up to :data:`MOVED` of the assignments); the loss's
value is the training pass's own. Evaluation counts in its one pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.distributed import ProcessGroup

from lightning_automodel.parallel.experts.load_balancing_loss import (
    Balancing,
    RouterStatistics,
    balancing_loss,
    router_statistics,
)

MOVED = 1e-3  # the share of assignments the training pass may route otherwise than the counting pass


class PipelineBalancing:
    """The statistics a rank's stages record, one micro-batch at a time, and what they add up to.

    ``groups``: the pp group and the data-parallel one (dp x cp), which together hold every layer and token once;
    ``data_parallel``: the ranks FSDP averages gradients over (the loss's gradient is injected that many times)."""

    def __init__(self, settings: Balancing, *, groups: Sequence[ProcessGroup], data_parallel: int) -> None:
        self.settings = settings
        self.groups = groups
        self.data_parallel = data_parallel
        self.counted: Tensor | None = None  # the counting pass's totals, for the training pass that follows
        self._recorded: dict[tuple[int, int], Tensor] = {}

    def start(self) -> None:
        """A new pass of the schedule (counting, training or evaluating)."""
        self._recorded = {}

    def record(
        self, router_logits: Sequence[Tensor], *, stage: int, rows: Tensor, token_mask: Tensor | None
    ) -> RouterStatistics | None:
        """The statistics of a stage's layers on a micro-batch (its ``rows`` of the batch); kept by stage and first
        row, so that a schedule's first run of a stage (inferring shapes) is replaced by the micro-batch's own. None
        where the stage has no router (its layers dense)."""
        if not router_logits:
            return None
        options = dict(num_experts=self.settings.num_experts, top_k=self.settings.top_k)
        statistics = router_statistics(router_logits, token_mask=token_mask, **options)
        totals = [statistics.assignments.sum(0), statistics.probabilities.detach().sum(0), statistics.token_layers]
        self._recorded[stage, int(rows[0])] = torch.cat(totals).double()  # counts past 2^24 stay exact
        return statistics

    def totals(self, device: torch.device) -> Tensor:
        """[assignments per expert, probabilities per expert, token-layers] over every layer and token."""
        experts = self.settings.num_experts
        recorded = [self._recorded[key] for key in sorted(self._recorded)]  # the same order in every pass
        totals = torch.stack(recorded).sum(0) if recorded else torch.zeros(2 * experts + 1, dtype=torch.float64)
        totals = totals.to(device)
        for group in self.groups:
            dist.all_reduce(totals, group=group)
        return totals

    def with_gradient(self, output: Tensor, statistics: RouterStatistics | None) -> Tensor:
        """``output`` (what the stage hands on), whose backward also gives the stage's routing probabilities their
        gradient of the loss (times the ranks FSDP averages over), from the counting pass's assignments."""
        if statistics is None:
            return output
        if self.counted is None:
            raise RuntimeError("The load-balancing loss's gradient needs the counting pass's assignments first.")
        experts = self.settings.num_experts
        assignments, token_layers = self.counted[:experts], self.counted[-1]
        scale = self.settings.weight * experts * self.data_parallel / token_layers.clamp_min(1) ** 2
        coefficient = (scale * assignments).to(statistics.probabilities.device, torch.float32)
        return _AddsGradient.apply(output, statistics.probabilities, coefficient)

    def loss(self, totals: Tensor) -> Tensor:
        """The loss's value from :meth:`totals`."""
        experts = self.settings.num_experts
        loss = balancing_loss(
            totals[:experts], totals[experts : 2 * experts], totals[-1].clamp_min(1), num_experts=experts
        )
        return loss.float()

    def check_routed_as_counted(self, totals: Tensor) -> None:
        """The training pass's assignments must be the counting pass's, whose coefficient its gradient took: up to a
        share :data:`MOVED` of them, which kernels chosen otherwise without gradients (SDPA's, bf16 sums) can move
        between near-tied experts, changing the gradient as little."""
        if is_fake(totals):  # a memory estimate: no values to compare
            return
        experts = self.settings.num_experts
        counted = self.counted[:experts].to(totals.device)
        moved = ((totals[:experts] - counted).abs().sum() / 2 / counted.sum().clamp_min(1)).item()
        if moved > MOVED:
            raise RuntimeError(
                f"The training pass routed {moved:.2%} of the assignments otherwise than the counting pass before it"
                f" (per expert {totals[:experts].tolist()} vs {counted.tolist()}), whose counts the load-balancing"
                " loss's gradient took. Something random between the router and the tokens (dropout, random"
                " routing) makes the two passes differ: turn it off, or set output_router_logits=False."
            )


class _AddsGradient(torch.autograd.Function):
    """Identity on ``output``; its backward gives ``probabilities`` the gradient ``coefficient`` per expert (the loss
    is linear in them once the assignments are known)."""

    @staticmethod
    def forward(ctx, output: Tensor, probabilities: Tensor, coefficient: Tensor) -> Tensor:
        ctx.save_for_backward(coefficient)
        ctx.layers = probabilities.shape[0]
        ctx.dtype = probabilities.dtype
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        (coefficient,) = ctx.saved_tensors
        return grad, coefficient.to(ctx.dtype).expand(ctx.layers, -1), None
