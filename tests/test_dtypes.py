"""Grouping parameters by compute dtype into FSDP units, on toy modules (no process group needed)."""

import pytest
import torch
from torch import nn

from lightning_automodel.parallel.fsdp.dtypes import (
    compute_dtype_resolver,
    iter_maximal_uniform_dtype_subtrees,
    keep_pinned_fp32,
)
from lightning_automodel.parallel.fsdp.sharding import dtype_units

BF16, FP32, FP64 = torch.bfloat16, torch.float32, torch.float64


def linear(dtype: torch.dtype, features: int = 4) -> nn.Linear:
    return nn.Linear(features, features, dtype=dtype)


class Block(nn.Module):
    def forward(self, x):
        return x


def block(**children: nn.Module) -> nn.Module:
    module = Block()
    for name, child in children.items():
        module.add_module(name, child)
    return module


def names(module: nn.Module, units) -> list[tuple[str, torch.dtype]]:
    path = {id(m): name for name, m in module.named_modules()}
    return [(path[id(unit)], dtype) for unit, dtype in units]


def storage(tensor: torch.Tensor) -> torch.dtype:
    return tensor.dtype


def test_maximal_uniform_subtrees_are_the_largest_and_disjoint():
    model = block(
        attn=linear(BF16),
        router=block(gate=linear(FP32), bias=linear(FP32)),
        mlp=block(up=linear(BF16), norm=linear(FP32)),
    )
    found = list(iter_maximal_uniform_dtype_subtrees(model, return_paths=True))
    assert [(path, dtype) for path, _, dtype in found] == [
        ("attn", BF16),
        ("router", FP32),
        ("mlp.up", BF16),
        ("mlp.norm", FP32),
    ]
    assert [module for module, _ in iter_maximal_uniform_dtype_subtrees(model)] == [m for _, m, _ in found]


def test_uniform_module_is_its_own_subtree():
    model = block(a=linear(BF16), b=block(c=linear(BF16)))
    assert list(iter_maximal_uniform_dtype_subtrees(model, return_paths=True)) == [("", model, BF16)]


def test_buffers_count_unless_excluded():
    layer = linear(BF16)
    layer.register_buffer("inv_freq", torch.ones(2, dtype=FP32))
    model = block(layer=layer, other=linear(FP32))
    assert list(iter_maximal_uniform_dtype_subtrees(model, return_paths=True)) == [("other", model.other, FP32)]
    without_buffers = iter_maximal_uniform_dtype_subtrees(model, include_buffers=False, return_paths=True)
    assert [(path, dtype) for path, _, dtype in without_buffers] == [("layer", BF16), ("other", FP32)]


def test_subtrees_without_selected_tensors_are_skipped():
    model = block(a=linear(FP32), frozen=linear(BF16))
    model.frozen.requires_grad_(False)
    found = list(iter_maximal_uniform_dtype_subtrees(model, tensor_pred=lambda t: t.requires_grad))
    assert found == [(model, FP32)]  # the frozen bf16 layer does not count, so the whole model is uniform


def test_a_module_shared_under_two_parents_is_yielded_once():
    shared = linear(FP32)
    model = block(x=block(s=shared, t=linear(BF16)), y=block(s=shared, u=linear(BF16)))
    found = list(iter_maximal_uniform_dtype_subtrees(model, return_paths=True))
    assert [(path, dtype) for path, _, dtype in found] == [("x.s", FP32), ("x.t", BF16), ("y.u", BF16)]


def test_compute_dtype_precedence():
    # Uniform fp32 storage is master weights: it computes in the policy's dtype, except what is pinned to fp32.
    uniform = block(mlp=block(gate=linear(FP32), up=linear(FP32)), moe_statics=linear(FP32))
    dtype_of = compute_dtype_resolver(uniform, param_dtype=BF16, fp32_module_names=("gate.weight", "moe_statics"))
    assert dtype_of(uniform.mlp.gate.weight) == FP32 and dtype_of(uniform.moe_statics.bias) == FP32
    assert dtype_of(uniform.mlp.gate.bias) == BF16 and dtype_of(uniform.mlp.up.weight) == BF16
    # A pin asks for at least fp32: a wider storage dtype stays, a narrower one computes in fp32.
    assert dtype_of(nn.Parameter(torch.ones(1, dtype=FP64))) == BF16  # not pinned: another tensor
    uniform.mlp.gate.to(FP64)
    assert (
        compute_dtype_resolver(uniform, param_dtype=BF16, fp32_module_names=("gate",))(uniform.mlp.gate.weight) == FP64
    )
    uniform.mlp.gate.to(BF16)
    assert (
        compute_dtype_resolver(uniform, param_dtype=BF16, fp32_module_names=("gate",))(uniform.mlp.gate.weight) == FP32
    )
    # Names match whole components: "gate" does not pin "gate_proj".
    assert (
        compute_dtype_resolver(block(gate_proj=linear(FP32)), param_dtype=BF16, fp32_module_names=("gate",))(
            torch.nn.Parameter(torch.ones(1))
        )
        == BF16
    )
    # Mixed storage: each parameter computes in its own storage dtype, whatever the policy.
    mixed = block(attn=linear(BF16), router=linear(FP32))
    dtype_of = compute_dtype_resolver(mixed, param_dtype=BF16)
    assert dtype_of(mixed.attn.weight) == BF16 and dtype_of(mixed.router.weight) == FP32
    # No policy: storage dtype.
    assert compute_dtype_resolver(uniform, param_dtype=None)(uniform.mlp.up.weight) == FP32
    assert dtype_of(torch.ones(2, dtype=torch.int64)) == torch.int64


def test_one_dtype_is_one_unit():
    model = block(a=linear(BF16), b=linear(BF16))
    assert names(model, dtype_units(model, storage)) == [("", BF16)]


def test_two_dtypes_cut_out_the_minority_only():
    model = block(
        attn=linear(BF16, 8),
        mlp=block(up=linear(BF16, 8), router=linear(FP32)),
        norm=block(weight_holder=linear(FP32)),
    )
    assert names(model, dtype_units(model, storage)) == [("mlp.router", FP32), ("norm", FP32), ("", BF16)]


def test_three_dtypes_cut_out_every_maximal_subtree():
    model = block(attn=linear(BF16, 8), mlp=block(up=linear(BF16, 8), router=linear(FP32)), extra=linear(FP64))
    units = names(model, dtype_units(model, storage))
    assert units == [("attn", BF16), ("mlp.up", BF16), ("mlp.router", FP32), ("extra", FP64), ("", BF16)]


def test_containers_without_forward_are_cut_into_their_modules():
    model = block(base=linear(BF16, 8), lora_A=nn.ModuleDict({"default": linear(FP32)}))
    assert names(model, dtype_units(model, storage)) == [("lora_A.default", FP32), ("", BF16)]


def test_parameters_that_cannot_be_isolated_are_named():
    model = block(attn=linear(BF16, 8), router=linear(BF16))
    model.router.bias = nn.Parameter(torch.zeros(4, dtype=FP32))  # one module holding bf16 and fp32 directly
    with pytest.raises(ValueError, match=r"router\.bias.*submodule of their own"):
        dtype_units(model, storage)


def test_a_cast_keeps_pinned_tensors_in_fp32_with_their_values():
    model = block(mlp=block(gate=linear(FP32), gate_proj=linear(FP32)), moe_statics=block())
    model.moe_statics.register_buffer("bias", torch.randn(3))
    original = model.mlp.gate.weight.detach().clone()
    with keep_pinned_fp32(model, ("gate.weight", "moe_statics")):
        model.to(BF16)
    assert model.mlp.gate.weight.dtype == FP32 and torch.equal(model.mlp.gate.weight, original)
    assert model.moe_statics.bias.dtype == FP32
    assert {model.mlp.gate.bias.dtype, model.mlp.gate_proj.weight.dtype} == {BF16}
