"""Materialize a parallelized Hugging Face model that was built on the meta device.

Random init of a DTensor on a CPU mesh repeats one shard on every rank, and FSDP shards would be initialised
independently per rank. Instead each module is initialised by the model's own ``_init_weights`` on full-size
tensors, with the same random state on every rank, and each rank keeps its own slice. Modules are visited in
the order ``PreTrainedModel.initialize_weights`` uses, so the result equals a single-process
``to_empty()`` + ``initialize_weights()`` from the same random state.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_automodel.parallel.lora import is_lora_layer


def materialize_hf_model(model: nn.Module, device: torch.device, *, skip: Collection[str] = ()) -> None:
    """Allocate ``model`` on ``device`` and initialise it as Hugging Face would, every rank holding its shard.

    ``skip``: names of parameters left uninitialised because something fills them next (a pretrained
    checkpoint): their modules draw nothing, and no full-size tensor is made for them.
    """
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"materialize_hf_model expects a transformers PreTrainedModel, got {type(model).__name__}.")
    model.to_empty(device=device)
    _share_random_state_of_rank0()
    with torch.no_grad():
        context = _Context(device=device, skip=set(skip), peft_config=getattr(model, "peft_config", {}))
        _init_post_order(model, owner=model, prefix="", context=context)


def _share_random_state_of_rank0() -> None:
    """Every rank draws the same full tensors: start from global rank 0's CPU random state."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    state = [torch.get_rng_state()]
    dist.broadcast_object_list(state, src=0)
    torch.set_rng_state(state[0])


@dataclass
class _Context:
    device: torch.device
    skip: set[str]  # parameter names filled afterwards (from a checkpoint)
    peft_config: dict  # the root model's: nested sub-models do not carry it
    done: set[int] = field(default_factory=set)  # parameters initialised (a tied one keeps its first values)


def _init_post_order(module: nn.Module, *, owner: nn.Module, prefix: str, context: _Context) -> None:
    """Children first, then the module, each sub-model with its own ``_init_weights`` (as HF's smart_apply)."""
    from transformers import PreTrainedModel

    for name, child in module.named_children():
        sub_owner = child if isinstance(child, PreTrainedModel) else owner
        _init_post_order(child, owner=sub_owner, prefix=f"{prefix}{name}.", context=context)
    _materialize_tensor_attributes(module, context.device)
    own = [f"{prefix}{name}" for name, _ in module.named_parameters(recurse=False)]
    if own and all(name in context.skip for name in own):
        owner._init_weights(_full_size_stand_in(module, device="meta"))  # its buffers only (Gemma's embed_scale)
        return
    if is_lora_layer(module):
        _init_lora_adapters(module, context.peft_config, done=context.done)
    _init_module(module, owner=owner, done=context.done)


def _materialize_tensor_attributes(module: nn.Module, device: torch.device) -> None:
    """Plain tensor attributes (rotary ``original_inv_freq``) are not moved by ``to_empty``."""
    for name, value in list(vars(module).items()):
        if isinstance(value, torch.Tensor) and value.is_meta:
            setattr(module, name, torch.empty_like(value, device=device))


def _init_module(module: nn.Module, *, owner: nn.Module, done: set[int]) -> None:
    """Initialise ``module``'s own parameters; a tied parameter keeps the values of its first module.

    Hugging Face initialises tied modules separately and ties afterwards, so the embedding's values win and
    lm_head's draw is discarded; drawing it here too keeps the random stream identical.
    """
    if not any(True for _ in module.parameters(recurse=False)):
        owner._init_weights(module)  # buffers only (rotary): they are not sharded, initialise in place
        return
    stand_in = _full_size_stand_in(module)  # same class and attributes, so _init_weights picks the same branch
    owner._init_weights(stand_in)
    _copy_shards(module, stand_in, done)


def _init_lora_adapters(module: nn.Module, peft_config: dict, *, done: set[int]) -> None:
    """Initialise a LoRA layer's adapters as PEFT does (``reset_lora_parameters``), after transformers' init
    has visited them as the plain Linears they are."""
    for adapter in module.lora_A:
        init = peft_config[adapter].init_lora_weights if adapter in peft_config else True
        if init is False:  # PEFT leaves the Linears' own init: transformers' draw stands
            continue
        if init not in (True, "gaussian") or getattr(module, "lora_magnitude_vector", None):
            raise ValueError(
                f"Adapters initialised with init_lora_weights={init!r} or DoRA need the base weights at"
                " creation; on a model built on the meta device use init_lora_weights=True, False or 'gaussian',"
                " or build the model with real weights."
            )
        pair = {"lora_A": module.lora_A[adapter], "lora_B": module.lora_B[adapter]}
        stand_ins = {which: _full_size_stand_in(layer) for which, layer in pair.items()}
        stand_in = unsharded_view(module)
        stand_in._modules = {
            **module._modules,
            **{which: nn.ModuleDict({adapter: s}) for which, s in stand_ins.items()},
        }
        stand_in.reset_lora_parameters(adapter, init)
        for which, layer in pair.items():
            done.difference_update(id(p) for p in layer.parameters(recurse=False))  # transformers' draw is replaced
            _copy_shards(layer, stand_ins[which], done)


def _full_size_stand_in(module: nn.Module, device: str = "cpu") -> nn.Module:
    """``module`` with its own parameters replaced by full-size, unsharded tensors to initialise (on the meta
    device: initialising them does nothing, while the module's buffers, shared, are initialised in place)."""
    stand_in = unsharded_view(module)
    stand_in._parameters = {  # keep entries registered as None (bias=False)
        name: None if value is None else nn.Parameter(torch.empty(value.shape, dtype=value.dtype, device=device), False)
        for name, value in module._parameters.items()
    }
    return stand_in


def _copy_shards(module: nn.Module, stand_in: nn.Module, done: set[int]) -> None:
    for name, param in module.named_parameters(recurse=False):
        if id(param) not in done:
            copy_shard(param, stand_in._parameters[name])
            done.add(id(param))


def unsharded_view(module: nn.Module) -> nn.Module:
    """A shallow stand-in for ``module`` of its class before ``fully_shard`` swapped in ``FSDP<class>``: same
    attributes (submodules and parameters shared, nothing copied), no FSDP hooks. Code that dispatches on the
    class (transformers' init and checkpoint mappings) sees the model's own class; ``copy.copy`` of an FSDP
    module would fail in FSDP's ``__new__``."""
    view = object.__new__(next(cls for cls in type(module).__mro__ if not issubclass(cls, FSDPModule)))
    view.__dict__.update(module.__dict__)
    return view


def copy_shard(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's shard of ``full`` into ``param`` (a DTensor, or a plain tensor taking all of it)."""
    if isinstance(param, DTensor):
        shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(shard)
    else:
        param.copy_(full)
