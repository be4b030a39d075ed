"""Shapes of the operations whose fake-tensor kernels refuse what their CPU kernels compute.

torch's meta function for ``_grouped_mm`` (the grouped matmul transformers' mixture-of-experts layers run by default)
takes bf16 alone, where the CPU kernel, and CUDA's since torch 2.9, compute fp32 too: a fake step of an fp32 model
stops there. The output's shape does not depend on the dtype, so it is the meta function's on bf16 stand-ins, in the
dtype the kernel returns (its ``out_dtype``, else its inputs').
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

_GROUPED_MM = torch.ops.aten._grouped_mm.default


class GroupedMatmulOfAnyDtype(TorchDispatchMode):
    """Fake ``_grouped_mm`` of any dtype (see the module's docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first, second = args[:2] if func is _GROUPED_MM else (None, None)
        fake = next((matrix for matrix in (first, second) if isinstance(matrix, FakeTensor)), None)
        if fake is None or first.dtype == torch.bfloat16:  # (a small input is a real tensor: a fake mode's too)
            return func(*args, **kwargs)
        dtype = kwargs.pop("out_dtype", None) or first.dtype
        with fake.fake_mode:
            shaped = func(first.to(torch.bfloat16), second.to(torch.bfloat16), *args[2:], **kwargs)
            return torch.empty_like(shaped, dtype=dtype)
