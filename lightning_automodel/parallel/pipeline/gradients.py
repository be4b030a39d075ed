"""The gradients a schedule step computes, held back until the returned loss's backward adds them: a training loop
may zero the gradients between its forward and its backward (Lightning's does) and scale the loss (gradient
accumulation), and gets what it expects."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

ParametersByName = Callable[[], dict[str, nn.Parameter]]


@contextmanager
def gradients_held_back(parameters: ParametersByName) -> Iterator[dict[str, Tensor]]:
    """Run the schedule's backward beside the gradients the ``parameters`` hold, and yield a dict that receives what
    it computes, by name, on leaving (the parameters then hold their own gradients again)."""
    held = {name: p.grad for name, p in parameters().items()}
    for p in parameters().values():
        p.grad = None
    computed: dict[str, Tensor] = {}
    try:
        yield computed
    finally:
        params = parameters()
        computed.update({name: p.grad for name, p in params.items() if p.grad is not None})
        for name, grad in held.items():
            params[name].grad = grad


def backward_adds_gradients(loss: Tensor, *, computed: dict[str, Tensor], parameters: ParametersByName) -> Tensor:
    """A leaf holding the loss, whose backward adds the ``computed`` gradients to the ``parameters`` (times the
    gradient it is given: 1 / accumulate_grad_batches under Lightning)."""
    loss = loss.requires_grad_()
    applied = []

    def add_computed_gradients(scale: Tensor) -> None:
        if applied:
            raise RuntimeError(
                "A second backward of one pipelined loss: the schedule computed the step's gradients once, in the"
                " model's call, and the first backward added them. Call the model again for another backward."
            )
        applied.append(True)
        params = parameters()
        for name, grad in computed.items():
            grad.mul_(scale.to(grad.device))  # the schedule's own tensor, scaled where it lies (CPU under offload)
            params[name].grad = grad if params[name].grad is None else params[name].grad + grad

    loss.register_hook(add_computed_gradients)
    return loss


def sharded_parameters(model: nn.Module, *, units: list[FSDPModule]) -> dict[str, nn.Parameter]:
    """The parameters that hold the gradients (and that the optimizer steps), by name in ``model``: those of its FSDP
    ``units``. The module may have other objects registered in their place: FSDP keeps the root's weights gathered
    from forward to backward and swaps them back only at the end of the next autograd backward. Read from FSDP's
    state, as torch's own pipeline stage does to reduce the gradients."""
    names = {id(module): name for name, module in model.named_modules()}
    parameters = {}
    for unit in units:
        for fsdp_param in (fsdp_param for group in param_groups(unit) for fsdp_param in group.fsdp_params):
            owner = fsdp_param._module_info
            prefix = names[id(owner.module)]
            parameters[f"{prefix}.{owner.param_name}" if prefix else owner.param_name] = fsdp_param.sharded_param
    return parameters


def param_groups(unit: FSDPModule) -> list:
    """The parameter groups FSDP's state keeps for ``unit`` (torch's pipeline stage reads them too; before torch 2.13,
    one group or none)."""
    state = unit._get_fsdp_state()
    if hasattr(state, "_fsdp_param_groups"):
        return state._fsdp_param_groups
    return [state._fsdp_param_group] if state._fsdp_param_group is not None else []
