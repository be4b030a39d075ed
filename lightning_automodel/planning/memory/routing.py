"""The routing a mixture-of-experts step is estimated under: the experts each token goes to, assumed, not computed.

A fake-tensor step has no values, so its router cannot say where tokens go, and what it allocates depends on it: the
rows each expert computes, and under expert parallel the rows each rank receives. The estimate therefore gives every
experts module the choices of an assumed routing, real CPU tensors (the router still runs, on fake tensors, for its
activations), so the dispatch code that sorts, counts and sends tokens runs on values. Every rank is taken to route
alike (the estimate's process group answers the token counts' exchange so, see
:func:`~lightning_automodel.planning.simulation.fake_world`): balanced, each expert gets ``tokens x top_k /
experts`` of a rank's choices; with an imbalance, the busiest expert gets that many times its balanced share, and it
lies on the estimated rank in every layer (the worst case for that rank), the rest spread evenly over the others.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lightning_automodel.parallel.experts.expert_parallel import experts_modules


@dataclass(frozen=True)
class ExpertRouting:
    """The routing a mixture-of-experts step is planned for (see the module's docstring)."""

    imbalance: float = 1.0
    """The busiest expert's share of a rank's (token, expert) choices, relative to a balanced share (1: balanced;
    2: twice the balanced share). At most experts / top_k: an expert takes a token once."""

    def __post_init__(self) -> None:
        if isinstance(self.imbalance, bool) or not isinstance(self.imbalance, int | float) or self.imbalance < 1:
            raise ValueError(
                f"expert_imbalance={self.imbalance!r}: the busiest expert's share relative to a balanced one, a"
                " number of at least 1 (1: balanced)."
            )

    def describe(self) -> str:
        """How the estimate routes tokens, for its reports."""
        if self.imbalance == 1:
            return "balanced (each expert gets tokens x top_k / experts of every rank's choices)"
        return (
            f"the busiest expert {self.imbalance:g}x its balanced share of every rank's choices, in every layer on the"
            " estimated rank, the rest balanced"
        )

    def choices(self, *, tokens: int, top_k: int, experts: int, busiest: int = 0) -> torch.Tensor:
        """The experts ``tokens`` tokens choose, [tokens, top_k]: each token distinct ones, ``busiest`` the most
        chosen."""
        counts = self.counts(tokens=tokens, top_k=top_k, experts=experts, busiest=busiest)
        # Column by column, expert by expert: an expert's run of at most ``tokens`` choices meets each token once.
        flat = torch.repeat_interleave(torch.arange(experts), counts)
        return flat.view(top_k, tokens).t().contiguous()

    def counts(self, *, tokens: int, top_k: int, experts: int, busiest: int = 0) -> torch.Tensor:
        """The choices each expert gets, [experts]: the busiest ``imbalance`` times a balanced share (at most one a
        token), the rest spread evenly."""
        pairs = tokens * top_k
        if self.imbalance * top_k > experts:
            raise ValueError(
                f"expert_imbalance={self.imbalance:g}: the busiest expert would get {self.imbalance:g} x {top_k} /"
                f" {experts} of the tokens, more than every token once; at most {experts / top_k:g} for {experts}"
                f" experts choosing {top_k} a token."
            )
        hot = pairs if experts == 1 else min(tokens, math.ceil(self.imbalance * pairs / experts))
        rest = torch.full((experts - 1,), (pairs - hot) // max(experts - 1, 1), dtype=torch.long)
        rest[: (pairs - hot) - int(rest.sum())] += 1
        return torch.cat([rest[:busiest], torch.tensor([hot]), rest[busiest:]])


def assumed_routing(model: nn.Module, imbalance: float) -> str | None:
    """How a step of ``model`` routes its tokens, for the reports; None for a model without experts."""
    return f"expert routing {ExpertRouting(imbalance).describe()}" if experts_modules(model) else None


@contextlib.contextmanager
def routed(model: nn.Module, routing: ExpertRouting) -> Iterator[bool]:
    """Every experts module of ``model`` given ``routing``'s choices for its tokens, in place of its router's, while
    inside; yields whether the model has any."""
    handles = [
        module.register_forward_pre_hook(_assumed_choices(routing), with_kwargs=True)
        for _, module in experts_modules(model)
    ]
    try:
        yield bool(handles)
    finally:
        for handle in handles:
            handle.remove()


def _assumed_choices(routing: ExpertRouting):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        # (tokens, expert indices, routing weights), passed by position or by the module's own names
        names = [name for name in inspect.signature(type(module).forward).parameters if name != "self"]
        if len(names) != 3:  # experts taking every token for every expert (Llama 4's): no choices to assume
            return None
        index = args[1] if len(args) > 1 else kwargs[names[1]]
        tokens, top_k = index.reshape(-1, index.shape[-1]).shape
        experts = module.num_experts
        group = getattr(module, "experts_group", None)  # under expert parallel: the busiest among this rank's
        busiest = 0 if group is None else dist.get_rank(group) * (experts // dist.get_world_size(group))
        choices = routing.choices(tokens=tokens, top_k=top_k, experts=experts, busiest=busiest)
        choices = choices.view(index.shape).to(index.dtype)
        if len(args) > 1:
            return (args[0], choices, *args[2:]), kwargs
        return args, {**kwargs, names[1]: choices}

    return hook
