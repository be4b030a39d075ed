"""Expert parallel: each ep rank holds whole experts, 1/ep of every experts module's, and tokens travel to their
experts and back by all-to-all; routing, the router's gradient and the load-balancing loss stay where the tokens are.
Experts that take every token for every expert (Llama 4's) get every expert's rows sent to the rank holding it.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import MethodType

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.nn.functional import all_to_all_single
from torch.distributed.tensor import DTensor, Shard

from lightning_automodel.hf.peft import is_lora_layer
from lightning_automodel.parallel.tensor.styles.experts import is_experts
from lightning_automodel.parallel.tensor.styles.parameters import local_parameters


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The experts modules of ``model`` (fused 3D experts), by name."""
    return [(name, module) for name, module in model.named_modules() if is_experts(module)]


def expert_parallel_problem(model: nn.Module, *, ep: int) -> str | None:
    """Why ``model``'s experts cannot be split over ``ep`` ranks, or None."""
    found = experts_modules(model)
    if not found:
        return (
            f"{type(model).__name__} has no mixture-of-experts layer holding its experts as fused 3D parameters"
            " (transformers 5's experts modules)"
        )
    modules = dict(model.named_modules())
    for name, module in found:
        if is_lora_layer(modules[name.rpartition(".")[0]]):
            return (
                f"{name} carries LoRA adapters on its expert parameters (peft's target_parameters), which expert"
                " parallel does not split yet: target the attention and dense layers only"
            )
        parameters = _forward_parameters(module)
        if len(parameters) not in (1, 3):
            return (
                f"{name} ({type(module).__name__}) takes ({', '.join(parameters)}), neither tokens, expert indices and"
                " routing weights nor every token for every expert: its tokens cannot be sent to their experts"
            )
        experts = _experts_count(module)
        if getattr(module, "num_experts", None) != experts:
            return f"{name} ({type(module).__name__}) does not count its experts in num_experts as transformers' do"
        if experts % ep:
            return f"{name} holds {experts} experts, which do not split over ep={ep} ranks"
    return None


def _forward_parameters(module: nn.Module) -> list[str]:
    return [p for p in inspect.signature(type(module).forward).parameters if p != "self"]


def _experts_count(module: nn.Module) -> int:
    return module.down_proj.shape[0]


def expert_precision_problem(model: nn.Module, reduce_dtype: torch.dtype | None) -> str | None:
    """Why the experts' gradients cannot be reduced in ``reduce_dtype`` (by default their own dtype), or None.

    FSDP2 (torch 2.13) divides an fp16 reduction before and after it, and again when the experts' shard group has one
    rank: with the divisor expert parallel sets, fp16 expert gradients would come out divided twice.
    """
    dtypes = {reduce_dtype} if reduce_dtype else {p.dtype for _, m in experts_modules(model) for p in m.parameters()}
    if torch.float16 in dtypes:
        return "expert gradients reduced in fp16 would be scaled wrong by FSDP2; train in bf16 (precision='bf16-true')"
    return None


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Keep this rank's experts of every experts module of ``model`` (a DTensor sharded on the expert dim) and
    dispatch tokens to them. ``mesh``: "ep", or ("ep", "tp") when the experts are already tensor parallel over tp.

    The ranks of an ep group read different tokens (ep is borrowed from dp_shard x cp, see
    :mod:`lightning_automodel.parallel.mesh`). Every layer sorts this rank's (token, choice) pairs by expert, exchanges
    the counts, sends each token to the rank holding its expert, runs the module's own forward there on its local
    experts, and sends the outputs back, to be weighted and summed where the token lives in expert order, in the hidden
    dtype, as transformers' eager loop does. Both all-to-alls run on every rank in every layer whatever its tokens
    chose, so uneven load cannot leave a rank waiting. Their backward is the reverse all-to-all, so each expert's
    gradient sums every rank's tokens; FSDP over "efsdp" then divides by the whole data-parallel size.
    """
    ep_mesh = mesh["ep"] if mesh.ndim > 1 else mesh
    for _, module in experts_modules(model):
        experts = _experts_count(module)
        for name, param in list(module.named_parameters(recurse=False)):
            local = _this_ranks_experts(param, ep_mesh=ep_mesh)
            placements = (Shard(0), *param.placements) if isinstance(param, DTensor) else (Shard(0),)
            distributed = DTensor.from_local(local, mesh, placements, run_check=False)
            module.register_parameter(name, nn.Parameter(distributed, requires_grad=param.requires_grad))
        # One function for every layer, what differs kept on the module, as the other forwards our plans give modules.
        # Expert tensor parallel's forward already computes on this rank's parts; without it, the module's own does.
        module.experts_forward = module.forward.__func__
        module.experts_on_local_parameters = mesh.ndim == 1
        module.experts_group, module.experts_count = ep_mesh.get_group(), experts
        every_token = len(_forward_parameters(module)) == 1
        module.forward = MethodType(_exchanged_forward if every_token else _dispatched_forward, module)


def _local_experts_forward(module: nn.Module, *args: torch.Tensor) -> torch.Tensor:
    """The experts module's forward (before dispatch) on the tokens that arrived, with this rank's experts."""
    if not module.experts_on_local_parameters:
        return module.experts_forward(module, *args)
    with local_parameters(module):
        return module.experts_forward(module, *args)


def _this_ranks_experts(param: torch.Tensor, *, ep_mesh: DeviceMesh) -> torch.Tensor:
    """This ep rank's experts of a parameter (its tp shard when it is a DTensor), a tensor of their own."""
    local = param.to_local() if isinstance(param, DTensor) else param.detach()
    return local.chunk(ep_mesh.size(), dim=0)[ep_mesh.get_local_rank()].clone()


def _dispatched_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    group, experts = self.experts_group, self.experts_count
    tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
    choices = top_k_index.reshape(tokens.shape[0], top_k_index.shape[-1])
    if top_k_weights.numel() != top_k_index.numel():
        raise ValueError(
            f"{type(self).__name__} got routing weights of shape {tuple(top_k_weights.shape)} for expert indices of"
            f" shape {tuple(top_k_index.shape)}: expert parallel needs one weight per chosen expert."
        )
    routes = _Routes.exchanged(choices.reshape(-1), experts=experts, group=group)
    token_of = routes.order // choices.shape[1]
    arrived = _exchange(tokens[token_of], sizes=routes.received, split_sizes=routes.sent, group=group)
    local_index = routes.local_experts_received()
    unweighted = torch.ones(local_index.shape, dtype=top_k_weights.dtype, device=top_k_weights.device)
    with _with_num_experts(self, routes.local_experts):
        computed = _local_experts_forward(self, arrived, local_index, unweighted)
    if arrived.requires_grad and not computed.requires_grad:
        # The eager loop returns a fresh zeros tensor when no token arrived: tie it to the tokens, or this rank would
        # skip the all-to-alls its peers run in backward.
        computed = computed + arrived.sum() * 0
    returned = _exchange(computed, sizes=routes.sent, split_sizes=routes.received, group=group)
    weights = top_k_weights.reshape(-1)[routes.order, None]
    combined = torch.zeros_like(tokens).index_add(0, token_of, (returned * weights).to(tokens.dtype))
    return combined.view(hidden_states.shape)


def _exchanged_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Experts taking every token for every expert (Llama 4's: (experts x tokens, hidden) rows, expert by expert, each
    token scaled by its routing weight, zero for experts it did not choose), as transformers computes them: every
    expert's rows go to the rank holding it, which runs its experts on every rank's tokens, and the outputs come back
    in the same layout. Exact, and dense as the module is: every token travels for every expert."""
    group, experts = self.experts_group, self.experts_count
    ranks, hidden = dist.get_world_size(group), hidden_states.shape[-1]
    local_experts = experts // ranks
    tokens = hidden_states.shape[0] // experts
    counts = _token_counts(tokens, group=group, device=hidden_states.device)  # ranks' batches may differ
    sent = [local_experts * tokens] * ranks
    received = [local_experts * count for count in counts]
    arrived = _exchange(hidden_states.reshape(experts * tokens, hidden), sizes=received, split_sizes=sent, group=group)
    by_expert = torch.cat([rows.view(local_experts, -1, hidden) for rows in arrived.split(received)], dim=1)
    computed = _local_experts_forward(self, by_expert.reshape(-1, hidden)).view(local_experts, -1, hidden)
    by_source = torch.cat([rows.reshape(-1, hidden) for rows in computed.split(counts, dim=1)])
    return _exchange(by_source, sizes=sent, split_sizes=received, group=group).view(hidden_states.shape)


def _token_counts(tokens: int, *, group: dist.ProcessGroup, device: torch.device) -> list[int]:
    """The number of tokens each rank of ``group`` holds in this layer."""
    counts = torch.empty(dist.get_world_size(group), dtype=torch.long, device=device)
    dist.all_gather_into_tensor(counts, torch.tensor([tokens], device=device), group=group)
    return counts.tolist()


@dataclass(frozen=True)
class _Routes:
    """Where this rank's (token, choice) pairs go in one layer, and what it receives from the others."""

    order: torch.Tensor  # the flattened choices sent, sorted by expert: so they go out rank by rank
    sent: list[int]  # pairs sent to each rank of the group
    received: list[int]  # pairs received from each rank
    received_per_expert: torch.Tensor  # pairs received, per (source rank, local expert)
    local_experts: int

    @classmethod
    def exchanged(cls, choices: torch.Tensor, *, experts: int, group: dist.ProcessGroup) -> _Routes:
        """Sort ``choices`` (expert indices) by expert and exchange the counts (one small all-to-all). An index past
        the last expert chooses none (transformers' sentinel): sorted last and never sent."""
        ranks = dist.get_world_size(group)
        local_experts = experts // ranks
        per_expert = torch.bincount(choices[choices < experts], minlength=experts)
        order = torch.argsort(choices, stable=True)[: int(per_expert.sum())]
        received_per_expert = torch.empty_like(per_expert)
        dist.all_to_all_single(received_per_expert, per_expert, group=group)
        return cls(
            order=order,
            sent=per_expert.view(ranks, local_experts).sum(1).tolist(),
            received=received_per_expert.view(ranks, local_experts).sum(1).tolist(),
            received_per_expert=received_per_expert,
            local_experts=local_experts,
        )

    def local_experts_received(self) -> torch.Tensor:
        """The local expert index of each pair received, [pairs, 1]: source by source, expert by expert."""
        ranks = len(self.received)
        index = torch.arange(self.local_experts, device=self.received_per_expert.device).repeat(ranks)
        return index.repeat_interleave(self.received_per_expert)[:, None]


def _exchange(
    rows: torch.Tensor, *, sizes: list[int], split_sizes: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """``rows`` split by ``split_sizes`` and sent to the ranks in order; ``sizes`` rows received from each."""
    output = rows.new_empty((sum(sizes), *rows.shape[1:]))
    return all_to_all_single(output, rows.contiguous(), sizes, split_sizes, group=group)


@contextmanager
def _with_num_experts(module: nn.Module, count: int) -> Iterator[None]:
    """The experts module's own forward sizes its routing by ``num_experts``: this rank's experts for one call."""
    held = module.num_experts
    module.num_experts = count
    try:
        yield
    finally:
        module.num_experts = held
