"""Materialize a parallelized Hugging Face model that was built on the meta device.

Random init of a DTensor on a CPU mesh repeats one shard on every rank, and FSDP shards would be initialised
independently per rank. Instead each module is initialised by the model's own ``_init_weights`` on full-size
tensors, with the same random state on every rank, and each rank keeps its own slice. Modules are visited in
the order ``PreTrainedModel.initialize_weights`` uses, so the result equals a single-process
``to_empty()`` + ``initialize_weights()`` from the same random state.

Two things a single process gets and a meta-device build loses are restored: the parameters of submodules that a
module's own ``_init_weights`` sets (Mamba's mixer initialises its ``dt_proj`` and ``out_proj``), and the buffers
that ``_init_weights`` leaves alone, whose values only the model's constructor computes (xIELU's ``beta``).
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.modules.module import register_module_parameter_registration_hook
from torch.nn.utils.parametrize import is_parametrized
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from lightning_automodel.hf.peft import is_lora_layer
from lightning_automodel.hf.ties import to_empty_tied


def materialize_hf_model(model: nn.Module, device: torch.device, *, skip: Collection[str] = ()) -> None:
    """Allocate ``model`` on ``device`` and initialise it as Hugging Face would, every rank holding its shard.

    ``skip``: names of parameters left uninitialised because something fills them next (a pretrained
    checkpoint): their modules draw nothing, and no full-size tensor is made for them.
    """
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"materialize_hf_model expects a transformers PreTrainedModel, got {type(model).__name__}.")
    to_empty_tied(model, device=device)
    _mark_unset(model)
    _share_random_state_of_rank0()
    with torch.no_grad():
        context = _Context(device=device, skip=set(skip), peft_config=getattr(model, "peft_config", {}))
        _init_post_order(model, owner=model, prefix="", context=context)
        _fill_from_constructor(model, buffers=_unset_buffers(model), parameters=sorted(context.unset))


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
    unset: set[str] = field(default_factory=set)  # parameters no _init_weights has written so far


def _init_post_order(module: nn.Module, *, owner: nn.Module, prefix: str, context: _Context) -> None:
    """Children first, then the module, each sub-model with its own ``_init_weights`` (as HF's smart_apply)."""
    from transformers import PreTrainedModel

    for name, child in module.named_children():
        sub_owner = child if isinstance(child, PreTrainedModel) else owner
        _init_post_order(child, owner=sub_owner, prefix=f"{prefix}{name}.", context=context)
    _materialize_tensor_attributes(module, context.device)
    own = [f"{prefix}{name}" for name, _ in module.named_parameters(recurse=False)]
    if own and all(name in context.skip for name in own):
        owner._init_weights(_stand_in(module, device="meta"))  # its buffers only (Gemma's embed_scale)
        return
    if is_lora_layer(module):
        _init_lora_adapters(module, context, prefix=prefix)
    _init_module(module, owner=owner, prefix=prefix, context=context)


def _materialize_tensor_attributes(module: nn.Module, device: torch.device) -> None:
    """Plain tensor attributes (rotary ``original_inv_freq``) are not moved by ``to_empty``."""
    for name, value in list(vars(module).items()):
        if isinstance(value, torch.Tensor) and value.is_meta:
            setattr(module, name, torch.empty_like(value, device=device))


def _init_module(module: nn.Module, *, owner: nn.Module, prefix: str, context: _Context) -> None:
    """Initialise ``module``'s own parameters and the submodules' parameters its ``_init_weights`` sets too; a tied
    parameter keeps the values of its first module.

    Hugging Face initialises tied modules separately and ties afterwards, so the embedding's values win and
    lm_head's draw is discarded; drawing it here too keeps the random stream identical. A submodule's parameter the
    module's init sets (after the submodule's own init, as in Hugging Face) is handed over with its current values.
    """
    reaches = [  # in one order on every rank: handing a sharded parameter over gathers it (a collective)
        (path, name)
        for path, name in sorted(_submodule_parameters_initialised(module, owner))
        if f"{prefix}{path}.{name}" not in context.skip
    ]
    stand_in = _stand_in(module, reaching=reaches)  # same class and attributes: _init_weights picks the same branch
    owner._init_weights(stand_in)
    _copy_shards(module, stand_in, context, prefix=prefix)
    for path, name in reaches:
        value = stand_in.get_submodule(path).get_parameter(name)
        copy_shard(module.get_submodule(path).get_parameter(name), value)
        _note_unset(context.unset, f"{prefix}{path}.{name}", value)


def _submodule_parameters_initialised(module: nn.Module, owner: nn.Module) -> set[tuple[str, str]]:
    """(submodule path, parameter name) of the submodules' parameters ``owner._init_weights(module)`` uses, found by
    running it on a meta-device stand-in, where it computes nothing and draws no random number."""
    inside = {
        id(param): (path, name)
        for path, sub in module.named_modules()
        if path
        for name, param in sub.named_parameters(recurse=False)
    }
    if not inside:
        return set()
    stand_in = _stand_in(module, device="meta", reaching=set(inside.values()))
    stand_in._buffers = {
        name: torch.empty_like(b, device="meta") for name, b in module._buffers.items() if b is not None
    }
    meta_ids = {id(stand_in.get_submodule(path).get_parameter(name)): (path, name) for path, name in inside.values()}
    with _TensorUses() as used:
        owner._init_weights(stand_in)
    return {meta_ids[tensor_id] for tensor_id in used.ids if tensor_id in meta_ids}


class _TensorUses(TorchFunctionMode):
    """Records the identity of every tensor a torch function is called with."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.ids.update(id(leaf) for leaf in tree_flatten((args, kwargs))[0] if isinstance(leaf, torch.Tensor))
        return func(*args, **(kwargs or {}))


def _init_lora_adapters(module: nn.Module, context: _Context, *, prefix: str) -> None:
    """Initialise a LoRA layer's adapters as PEFT does (``reset_lora_parameters``), after transformers' init
    has visited them as the plain Linears they are."""
    for adapter in module.lora_A:
        init = context.peft_config[adapter].init_lora_weights if adapter in context.peft_config else True
        if init is False:  # PEFT leaves the Linears' own init: transformers' draw stands
            continue
        if init not in (True, "gaussian") or getattr(module, "lora_magnitude_vector", None):
            raise ValueError(
                f"Adapters initialised with init_lora_weights={init!r} or DoRA need the base weights at"
                " creation; on a model built on the meta device use init_lora_weights=True, False or 'gaussian',"
                " or build the model with real weights."
            )
        pair = {"lora_A": module.lora_A[adapter], "lora_B": module.lora_B[adapter]}
        stand_ins = {which: _stand_in(layer) for which, layer in pair.items()}
        stand_in = unsharded_view(module)
        stand_in._modules = {
            **module._modules,
            **{which: nn.ModuleDict({adapter: s}) for which, s in stand_ins.items()},
        }
        stand_in.reset_lora_parameters(adapter, init)
        for which, layer in pair.items():
            # transformers' draw is replaced
            context.done.difference_update(id(p) for p in layer.parameters(recurse=False))
            _copy_shards(layer, stand_ins[which], context, prefix=f"{prefix}{which}.{adapter}.")


def _stand_in(module: nn.Module, device: str = "cpu", reaching: Collection[tuple[str, str]] = ()) -> nn.Module:
    """``module`` with its own parameters replaced by full-size, unsharded tensors to initialise (on the meta
    device: initialising them does nothing); its own sharded buffers by their full values, and its plain buffers
    shared, so that they are initialised in place.

    ``reaching``: (submodule path, parameter name) of submodules' parameters the module's init sets too: those
    submodules get stand-ins holding those parameters' full current values.
    """
    stand_in = unsharded_view(module)
    stand_in._parameters = {  # keep entries registered as None (bias=False)
        name: None if value is None else nn.Parameter(_unset(value, device), False)
        for name, value in module._parameters.items()
    }
    stand_in._buffers = {
        name: _full_value(value, device) if isinstance(value, DTensor) else value
        for name, value in module._buffers.items()
    }
    if reaching:
        stand_in._modules = _children_holding_full(module, reaching, device)
    return stand_in


def _children_holding_full(
    module: nn.Module, reaching: Collection[tuple[str, str]], device: str
) -> dict[str, nn.Module | None]:
    """``module``'s children, those holding a listed parameter as views whose listed parameters hold their full
    current values (on the meta device: empty)."""
    by_child: dict[str, list[tuple[str, str]]] = {}
    for path, name in sorted(reaching):
        child, _, rest = path.partition(".")
        by_child.setdefault(child, []).append((rest, name))
    children = dict(module._modules)
    for child_name, listed in by_child.items():
        view = unsharded_view(children[child_name])
        own = {name for path, name in listed if not path}
        view._parameters = {
            name: _full_copy(value, device) if name in own and value is not None else value
            for name, value in view._parameters.items()
        }
        deeper = [(path, name) for path, name in listed if path]
        if deeper:
            view._modules = _children_holding_full(children[child_name], deeper, device)
        children[child_name] = view
    return children


def _full_copy(param: torch.Tensor, device: str) -> nn.Parameter:
    return nn.Parameter(_full_value(param, device), False)


def _full_value(tensor: torch.Tensor, device: str) -> torch.Tensor:
    """A copy of ``tensor``'s whole value (gathered, for a DTensor: a collective), or an empty one on meta."""
    if device == "meta":
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach().clone()


def _unset(param: torch.Tensor, device: str) -> torch.Tensor:
    """A full-size tensor for ``param``'s initial values, filled with a mark no initialisation writes (NaN)."""
    if param.dtype.is_floating_point:
        return torch.full(param.shape, float("nan"), dtype=param.dtype, device=device)
    return torch.empty(param.shape, dtype=param.dtype, device=device)


def _copy_shards(module: nn.Module, stand_in: nn.Module, context: _Context, *, prefix: str) -> None:
    for name, param in module.named_parameters(recurse=False):
        if id(param) not in context.done:
            copy_shard(param, stand_in._parameters[name])
            _note_unset(context.unset, f"{prefix}{name}", stand_in._parameters[name])
            context.done.add(id(param))
    for name, buffer in module.named_buffers(recurse=False):
        if isinstance(buffer, DTensor):
            copy_shard(buffer, stand_in._buffers[name])


def _note_unset(unset: set[str], name: str, initial: torch.Tensor) -> None:
    """Keep track of the parameters whose full initial values still hold the mark of :func:`_unset` (every rank
    sees the same full values)."""
    if initial.is_meta or not initial.dtype.is_floating_point or not initial.numel():
        return
    if bool(initial.isnan().all()):
        unset.add(name)
    else:
        unset.discard(name)


def _mark_unset(model: nn.Module) -> None:
    """Fill every buffer with a value no initialisation writes (NaN, the integer maximum), to find the ones
    ``_init_weights`` leaves alone (see :func:`_unset_buffers`)."""
    for buffer in model.buffers():
        local = buffer.to_local() if isinstance(buffer, DTensor) else buffer
        if _holds_nan(local):
            local.fill_(float("nan"))
        elif local.dtype != torch.bool:
            local.fill_(torch.iinfo(local.dtype).max)


def _holds_nan(tensor: torch.Tensor) -> bool:
    """Whether the tensor's dtype has a NaN: floating point, or complex (Llama 4's rotary frequencies)."""
    return tensor.dtype.is_floating_point or tensor.dtype.is_complex


def _unset_buffers(model: nn.Module) -> list[str]:
    """Buffers still holding the mark of :func:`_mark_unset` (boolean ones cannot hold one: all of them)."""
    unset = []
    for name, buffer in model.named_buffers():
        local = buffer.to_local() if isinstance(buffer, DTensor) else buffer
        if local.dtype == torch.bool:
            unset.append(name)
        elif local.numel() and bool(
            local.isnan().all() if _holds_nan(local) else (local == torch.iinfo(local.dtype).max).all()
        ):
            unset.append(name)
    return unset


def _fill_from_constructor(model: nn.Module, *, buffers: Sequence[str], parameters: Sequence[str]) -> None:
    """Give the buffers and parameters ``_init_weights`` leaves alone the values the model's constructor gives them
    (xIELU's learned scalars, Conv1D's weights in models whose init skips them), read from a second construction of
    the model in which only those parameters are made real (its buffers only cost memory)."""
    if not buffers and not parameters:
        return
    owners = [name.rpartition(".") for name in parameters]
    kinds = {(_unsharded_class(model.get_submodule(path)), leaf) for path, _, leaf in owners}
    kinds |= _parametrized_weights(model, parameters)
    fresh = _constructed_with_meta_parameters(model, real=kinds)
    values = {**dict(fresh.named_buffers()), **{n: p for n, p in fresh.named_parameters() if not p.is_meta}}
    missing = [name for name in [*buffers, *parameters] if name not in values]
    if missing:
        raise ValueError(
            f"{type(model).__name__}'s {missing} are neither initialised by its _init_weights nor made by its"
            " constructor: a model built on the meta device cannot compute them. Build the model with real weights."
        )
    for name in [*buffers, *parameters]:
        tensor = model.get_buffer(name) if name in buffers else model.get_parameter(name)
        copy_shard(tensor, values[name].detach().to(tensor.dtype))


def _parametrized_weights(model: nn.Module, parameters: Sequence[str]) -> set[tuple[type, str]]:
    """The (module class, weight) kinds behind the originals of parametrized weights among ``parameters``
    (``conv.parametrizations.weight.original0``, a weight norm's: WavTokenizer's), which the parametrization makes from
    the module's own weight as constructed."""
    kinds = set()
    for name in parameters:
        path, found, rest = name.partition(".parametrizations.")
        if found:
            module = model.get_submodule(path)  # a Parametrized<class>, made when the parametrization was added
            owner = _unsharded_class(module).__bases__[0] if is_parametrized(module) else _unsharded_class(module)
            kinds.add((owner, rest.partition(".")[0]))
    return kinds


def _unsharded_class(module: nn.Module) -> type:
    """``module``'s own class, not the ``FSDP<class>`` that ``fully_shard`` swapped in."""
    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def _constructed_with_meta_parameters(model: nn.Module, *, real: Collection[tuple[type, str]] = ()) -> nn.Module:
    """A fresh model of ``model``'s class and config whose parameters are on the meta device, except those of the
    ``real`` (module class, parameter name) kinds, and whose buffers are real."""
    cls = _unsharded_class(model)

    def to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        if param is None or param.is_meta or (type(module), name) in real:
            return None
        return nn.Parameter(torch.empty_like(param, device="meta"), param.requires_grad)

    handle = register_module_parameter_registration_hook(to_meta)
    try:
        return cls._from_config(copy.deepcopy(model.config))
    finally:
        handle.remove()


def unsharded_view(module: nn.Module) -> nn.Module:
    """A shallow stand-in for ``module`` of its class before ``fully_shard`` swapped in ``FSDP<class>``: same
    attributes (submodules and parameters shared, nothing copied), no FSDP hooks. Code that dispatches on the
    class (transformers' init and checkpoint mappings) sees the model's own class; ``copy.copy`` of an FSDP
    module would fail in FSDP's ``__new__``. Sizes tensor parallel made this rank's (``global_sizes``: a Mamba-2
    mixer's heads, whose init reads them) are the whole model's again."""
    view = object.__new__(_unsharded_class(module))
    view.__dict__.update(module.__dict__)
    view.__dict__.update(getattr(module, "global_sizes", {}))  # sizes tensor parallel made this rank's, whole again
    return view


def copy_shard(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's shard of ``full`` into ``param`` (a DTensor, or a plain tensor taking all of it)."""
    if isinstance(param, DTensor):
        shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(shard)
    else:
        param.copy_(full)
