"""Tensor parallel for PEFT LoRA layers, so that plans shard LoRA-wrapped models unchanged: each LoRA layer is
sharded like the projection it wraps (see :class:`LoraParallel`).
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_automodel.hf.peft import is_lora_layer
from lightning_automodel.parallel.tensor.styles.projections import PackedColwiseParallel

_LORA_STYLES = (ColwiseParallel, RowwiseParallel, PackedColwiseParallel)


def lora_aware(plan: dict[str, ParallelStyle], model: nn.Module) -> dict[str, ParallelStyle]:
    """``plan`` with every Linear style able to shard a LoRA layer too (unchanged for a model without LoRA)."""
    if not any(is_lora_layer(module) for module in model.modules()):
        return plan
    return {
        pattern: LoraParallel(style) if isinstance(style, _LORA_STYLES) else style for pattern, style in plan.items()
    }


class LoraParallel(ParallelStyle):
    """``style`` for a LoRA layer, ``base(x) + B(A(x)) * scaling``; a plain Linear gets ``style`` itself.

    * column-parallel (q/k/v, gate/up): ``B`` is split on its output rows like the base weight, ``A`` is replicated;
      every rank computes the full low-rank ``A(x)`` and its own slice of ``B(A(x))``. No collective is added in
      forward; in backward ``A``'s gradient, partial on each rank, is summed.
    * row-parallel (o, down): ``A`` is split on its input columns like the base weight, ``B`` is replicated; the
      low-rank path stays a partial sum, reduced together with the base output by the one reduction it needs anyway.

    ``style`` keeps the layer's edges (input and output layouts, reduction), now around the whole LoRA layer, so
    sequence parallel and the special styles work as they do without LoRA.
    """

    def __init__(self, style: ColwiseParallel | RowwiseParallel | PackedColwiseParallel) -> None:
        super().__init__()
        self.style = style

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_lora_layer(module):
            return self.style._apply(module, device_mesh)
        if not isinstance(module.base_layer, nn.Linear):
            raise TypeError(
                f"LoRA on a {type(module.base_layer).__name__} cannot be tensor parallel here: only Linear layers"
                " (attention and MLP projections) can. Leave it out of target_modules, or use tp=1."
            )
        if isinstance(self.style, PackedColwiseParallel):
            return self._apply_packed(module, device_mesh)
        rowwise = isinstance(self.style, RowwiseParallel)
        sharded, replicated = (module.lora_A, module.lora_B) if rowwise else (module.lora_B, module.lora_A)
        for layer in (module.base_layer, *sharded.values()):
            self.style._partition_linear_fn("", layer, device_mesh)
        for layer in replicated.values():
            _replicate(layer, device_mesh)
        for layer in module.lora_A.values():  # DoRA feeds A a plain identity matrix to form B @ A
            distribute_module(layer, device_mesh, input_fn=partial(_dtensor_inputs, (Shard(-1),) if rowwise else None))
        for magnitude in getattr(module, "lora_magnitude_vector", {}).values():  # DoRA: one scale per output row
            (_replicate if rowwise else partial(self.style._partition_linear_fn, ""))(magnitude, device_mesh)
        # What the matmul needs (RowwiseParallel sets it only inside its own _apply).
        desired = (Shard(-1),) if rowwise else self.style.desired_input_layouts
        return distribute_module(
            module,
            device_mesh,
            input_fn=partial(self.style._prepare_input_fn, self.style.input_layouts, desired),
            output_fn=partial(self.style._prepare_output_fn, self.style.output_layouts, self.style.use_local_output),
        )

    def _apply_packed(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        """Packed projections compute on local tensors inside the base layer; ``B`` is packed like it, and ``A``,
        replicated, hands it a replicated DTensor, whose gradient the packed layer sums over tp."""
        if getattr(module, "lora_magnitude_vector", None):
            raise TypeError(
                "DoRA on a packed projection (Phi3's qkv_proj, gate_up_proj; Qwen2-VL's vision tower qkv) is not"
                " supported with tp > 1: its magnitude is one scale per output row, split block by block. Leave it"
                " out of target_modules, use plain LoRA there (use_dora=False), or tp=1."
            )
        for layer in (module.base_layer, *module.lora_B.values()):
            self.style._apply(layer, device_mesh)
        for layer in module.lora_A.values():
            _replicate(layer, device_mesh)
            distribute_module(layer, device_mesh, input_fn=partial(_dtensor_inputs, None))
        return module


def _replicate(module: nn.Module, device_mesh: DeviceMesh) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        replicated = distribute_tensor(param, device_mesh, [Replicate()])
        module.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))


def _dtensor_inputs(placements: tuple | None, module: nn.Module, inputs: tuple, device_mesh: DeviceMesh) -> tuple:
    """Plain inputs are taken as replicated and, if ``placements`` are given, redistributed (sliced) to them."""
    converted = []
    for x in inputs:
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
            x = x.redistribute(device_mesh, placements) if placements else x
        converted.append(x)
    return tuple(converted)
