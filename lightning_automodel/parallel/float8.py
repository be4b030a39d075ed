"""``float8``: the decoder blocks' linear layers compute in float8 through torchao (its ``Float8Linear``).

Each matmul casts its input, weight and output gradient to float8 with a dynamic scale ("tensorwise": one scale a
tensor, the fastest; "rowwise": one a row, closer to bf16) and runs on the GPU's float8 tensor cores; weights,
gradients and optimizer state stay in their own precision. The cast's amax is taken over the whole logical tensor,
DTensors included, so tensor parallel does not change a scale. With tensorwise scaling FSDP2 all-gathers the weights
in float8 (half the bytes of bf16; the scales of all of them computed in one all-reduce after each optimizer step;
not with CPU offload) and tensor parallel's column- and row-wise styles cast before their collectives (torchao's
float8 styles; sequence parallel's norms still gather the stream in high precision). Converted after the pipeline
split and context parallel, before tensor parallel, activation checkpointing, compile and FSDP2.

The language model's blocks only: a vision-language model's tower stays in high precision (its blocks are listed as
kept, with that reason). Plain ``nn.Linear`` layers only: transformers' fused experts and most routers are modules of
their own, and LoRA's layers keep theirs, so they stay in high precision (a router that is a plain ``nn.Linear``, as
AFMoE's, is converted unless ``skip`` names it). Layers also stay there where the kernels cannot take their shapes
(``torch._scaled_mm`` needs both dims of a weight, as this rank holds it under tp, to be multiples of 16), where a
tensor-parallel style other than the plain column- and row-wise ones computes with the weight itself (packed
projections) or the plan leaves the weight whole at tp > 1 (on another mesh than the others, whose scales one
all-reduce computes), and where ``skip`` names them: each is logged with its reason (and listed in the plan report),
and a model with nothing to convert is refused. A device without float8 matmuls (compute capability below 8.9, or a
CPU) is refused; ``emulate=True`` runs torchao's emulation there (float8 casts, matmuls in high precision): float8's
numerics without its speed, for tests.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_automodel.hf.decoder_layers import named_multimodal_parts
from lightning_automodel.hf.peft import is_lora_layer
from lightning_automodel.parallel.tensor.plans.patterns import pattern_matches

log = logging.getLogger(__name__)

KERNEL_MULTIPLE = 16
"""``torch._scaled_mm`` takes matrices whose dims are multiples of 16."""

Float8Spec = bool | dict[str, Any]


@dataclass(frozen=True)
class Float8Options:
    """What ``float8=`` asks for (``True``: the defaults; a dict: these fields)."""

    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """torchao's scaling recipe: "tensorwise" (one scale a tensor; FSDP2 and tp gather in float8) or "rowwise" (one
    scale a row of each operand, more accurate; gathers in high precision)."""

    emulate: bool = False
    """torchao's emulation: float8 casts, matmuls in high precision. Float8's numerics on any device (tests)."""

    skip: tuple[str, ...] = ()
    """Module name patterns (``*`` a path component) left in high precision."""

    def __post_init__(self) -> None:
        if self.recipe not in ("tensorwise", "rowwise"):
            raise ValueError(f"float8 recipe={self.recipe!r}: use 'tensorwise' or 'rowwise'.")
        if not isinstance(self.emulate, bool):
            raise ValueError(f"float8 emulate={self.emulate!r}: a flag, True or False.")
        object.__setattr__(self, "skip", tuple(self.skip))


def float8_options(spec: Float8Spec | Float8Options | None) -> Float8Options | None:
    """The options ``float8=`` asks for; None when off."""
    if isinstance(spec, Float8Options) or spec is False or spec is None:
        return spec or None
    if spec is True:
        return Float8Options()
    if not isinstance(spec, dict):
        raise ValueError(f"float8={spec!r}: use False, True or a dict of {_FIELDS}.")
    unknown = sorted(set(spec) - set(_FIELDS))
    if unknown:
        raise ValueError(f"float8={spec!r}: {', '.join(unknown)} not among its options ({', '.join(_FIELDS)}).")
    return Float8Options(**spec)


_FIELDS = tuple(option.name for option in dataclasses.fields(Float8Options))


def float8_device_problem(options: Float8Options, device_type: str) -> str | None:
    """Why the mesh's device cannot train in float8 (torchao missing, no float8 matmuls), or None."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return "it needs torchao: pip install torchao"
    if options.emulate:
        return None
    if device_type != "cuda":
        return (
            f"{device_type} has no float8 matmuls; float8={{'emulate': True}} runs torchao's emulation (float8's"
            " numerics, no speed-up), for tests"
        )
    capability = torch.cuda.get_device_capability()
    if capability < (8, 9):
        name = torch.cuda.get_device_name()
        return (
            f"{name} (compute capability {capability[0]}.{capability[1]}) has no float8 matmuls: they need 8.9 or"
            " newer (Ada, Hopper, Blackwell). Train in bf16 (float8=False)"
        )
    return None


@dataclass
class Float8Layers:
    """Which linear layers of the decoder blocks compute in float8, and why the others do not."""

    converted: list[str]
    kept: dict[str, str]  # module name -> why it stays in high precision

    def summary(self) -> str:
        kept = "; ".join(f"{name}: {why}" for name, why in list(self.kept.items())[:6])
        more = f"; and {len(self.kept) - 6} more" if len(self.kept) > 6 else ""
        return f"{len(self.converted)} linear layers in float8" + (
            f", {len(self.kept)} kept in high precision ({kept}{more})" if self.kept else ""
        )


def float8_layers(
    model: nn.Module,
    layers: Sequence[tuple[str, nn.Module]],
    options: Float8Options,
    *,
    tp_styles: Mapping[str, ParallelStyle],
    tp: int,
) -> Float8Layers:
    """The linear layers of ``layers`` (decoder blocks, by name) to convert; refused when none qualifies. A
    vision-language model's tower blocks stay in high precision: float8 converts the language model."""
    converted, kept = [], {}
    towers = tuple(f"{name}." for name, _ in named_multimodal_parts(model))
    for block_name, block in layers:
        adapted = [f"{child}." for child, module in block.named_modules() if is_lora_layer(module)]
        for child, module in block.named_modules():
            if type(module) is not nn.Linear or child.startswith(tuple(adapted)):  # LoRA's layers keep their own
                continue
            name = f"{block_name}.{child}"
            if name.startswith(towers):
                kept[name] = "in the vision tower (float8 converts the language model)"
                continue
            why = _kept_because(name, module, options, tp_styles=tp_styles, tp=tp)
            if why is None:
                converted.append(name)
            else:
                kept[name] = why
    if not converted:
        found = Float8Layers(converted, kept)
        raise ValueError(
            f"float8 converts no linear layer of {type(model).__name__}'s decoder blocks: {found.summary()}."
            " Use float8=False."
        )
    return Float8Layers(converted, kept)


def _kept_because(
    name: str,
    module: nn.Linear,
    options: Float8Options,
    *,
    tp_styles: Mapping[str, ParallelStyle],
    tp: int,
) -> str | None:
    if any(pattern_matches(pattern, name) for pattern in options.skip):
        return "named in float8 skip"
    out_features, in_features = module.weight.shape
    style = next((style for pattern, style in tp_styles.items() if pattern_matches(pattern, name)), None)
    if style is None and tp > 1:  # its weight would sit on another mesh than the others', which one all-reduce scales
        return "left whole on every tp rank by the tensor-parallel plan"
    if style is not None and type(style) not in (ColwiseParallel, RowwiseParallel):
        return f"tensor parallel's {type(style).__name__} computes with its weight itself"
    if isinstance(style, ColwiseParallel):
        out_features //= tp
    elif isinstance(style, RowwiseParallel):
        in_features //= tp
    if out_features % KERNEL_MULTIPLE or in_features % KERNEL_MULTIPLE:
        held = "" if style is None else " on each tp rank"
        return f"its weight is {out_features} x {in_features}{held}, not multiples of {KERNEL_MULTIPLE}"
    return None


def convert_to_float8(model: nn.Module, found: Float8Layers, options: Float8Options, *, fsdp_sharded: bool) -> None:
    """Swap the layers ``found`` converts for torchao's ``Float8Linear`` (on any device, the meta one included)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(options.recipe)
    config = dataclasses.replace(
        config,
        emulate=options.emulate,
        enable_fsdp_float8_all_gather=fsdp_sharded and options.recipe == "tensorwise",
    )
    chosen = {id(model.get_submodule(name)) for name in found.converted}
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, _: id(module) in chosen)
    log.info("Float8 (%s scaling%s): %s", options.recipe, ", emulated" if options.emulate else "", found.summary())


def float8_tp_styles(styles: Mapping[str, ParallelStyle], model: nn.Module) -> dict[str, ParallelStyle]:
    """Tensor parallel's styles with torchao's float8 ones (casting before their collectives) for the converted
    layers (tensorwise scaling only: torchao's styles cast with one scale a tensor); a pattern matching converted
    and plain layers is split into their names."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    modules = list(model.named_modules())
    swapped: dict[str, ParallelStyle] = {}
    for pattern, style in styles.items():
        float8_style = {ColwiseParallel: Float8ColwiseParallel, RowwiseParallel: Float8RowwiseParallel}.get(type(style))
        matched = [(name, module) for name, module in modules if pattern_matches(pattern, name)]
        converted = [isinstance(module, Float8Linear) for _, module in matched]
        if float8_style is None or not any(converted):
            swapped[pattern] = style
            continue
        twin = float8_style(
            input_layouts=style.input_layouts[0],
            output_layouts=style.output_layouts[0],
            use_local_output=style.use_local_output,
        )
        if all(converted):
            swapped[pattern] = twin
        else:
            swapped.update({name: twin if isinstance(m, Float8Linear) else style for name, m in matched})
    return swapped


def precompute_float8_scales(model: nn.Module) -> None:
    """After an optimizer step: the float8 scales of every FSDP2-sharded float8 weight in one all-reduce (each
    all-gather would otherwise reduce its own)."""
    if any(_gathers_in_float8(module) for module in model.modules()):
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)


def _gathers_in_float8(module: nn.Module) -> bool:
    config = getattr(module, "config", None)
    return type(module).__name__ == "Float8Linear" and getattr(config, "enable_fsdp_float8_all_gather", False)
