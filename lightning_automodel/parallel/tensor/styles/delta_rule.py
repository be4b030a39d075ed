"""Tensor parallel for linear attention by the gated delta rule, as transformers writes it: the Gated DeltaNet of
Qwen3-Next, Qwen3.5, OLMo hybrid and Lara mini, and Kimi's delta attention (Kimi-Linear, Bailing hybrid). Heads are
independent from the projections to the gated norm, so they split over tp as attention's do: the query, key, value,
gate and per-head projections are column-parallel, the depthwise convolution over [q; k; v] and the per-head decay
parameters follow the heads, the output projection is row-parallel; the module's own code then runs on this rank's
heads, its sizes made this rank's."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from lightning_automodel.parallel.tensor.styles.parameters import localize_sizes, summed_gradient
from lightning_automodel.parallel.tensor.styles.projections import (
    Blocks,
    PackedColwiseParallel,
    RegroupedColwiseParallel,
)
from lightning_automodel.parallel.tensor.styles.state_space import StateSpaceMixerParallel, channels_of, own_parameters

# The projections of a delta-rule mixer by the width of their output, under the names transformers' copies give them.
_KEY_WIDE = ("q_proj", "k_proj")
_VALUE_WIDE = ("v_proj", "g_proj", "in_proj_z", "g_b_proj", "f_proj", "f_b_proj")
_PER_HEAD = ("a_proj", "b_proj", "in_proj_a", "in_proj_b")
_PACKED_QKV = "in_proj_qkv"
_LOW_RANK = ("f_a_proj", "g_a_proj")  # Kimi's down-projections of its gates: whole, their gradient summed by the up
_OUTPUT = ("o_proj", "out_proj")
# Sizes the module's code reads, by the quantity they count (KDA has one count of heads for keys and values).
_SIZES = ("num_k_heads", "num_v_heads", "num_heads", "key_dim", "value_dim", "qkv_dim", "conv_dim")


@dataclass(frozen=True)
class _Heads:
    """A delta-rule mixer's heads: key and value heads (GDN may have more value heads) and their total widths."""

    keys: int
    values: int
    key_width: int
    value_width: int

    @classmethod
    def of(cls, module: nn.Module) -> _Heads:
        heads = getattr(module, "num_heads", None)
        keys, values = getattr(module, "num_k_heads", heads), getattr(module, "num_v_heads", heads)
        width = getattr(module, "qkv_dim", None)
        return cls(keys, values, getattr(module, "key_dim", width), getattr(module, "value_dim", width))


def is_delta_rule_mixer(module: nn.Module) -> bool:
    """A gated delta-rule mixer: head counts, a depthwise convolution over [q; k; v], a learned decay ``A_log`` (its
    own or its forget gate's) and an output projection."""
    heads = _Heads.of(module)
    conv = getattr(module, "conv1d", None)
    decay = getattr(module, "A_log", None)
    if decay is None:
        decay = getattr(getattr(module, "forget_gate", None), "A_log", None)
    return (
        all(isinstance(size, int) for size in (heads.keys, heads.values, heads.key_width, heads.value_width))
        and isinstance(conv, nn.Conv1d)
        and conv.groups == conv.in_channels == 2 * heads.key_width + heads.value_width
        and isinstance(decay, nn.Parameter)
        and sum(isinstance(getattr(module, name, None), nn.Linear) for name in _OUTPUT) == 1
    )


class DeltaRuleMixerParallel(StateSpaceMixerParallel):
    """A delta-rule mixer's heads split over tp (each rank its key heads and the value heads that read them).

    Projections are column-parallel by what they make (keys, values, a gate or one value per head; Qwen3-Next's
    fused ones are laid out key head by key head, so a plain split keeps whole groups); a fused [q; k; v] of unequal
    blocks is regrouped (:class:`RegroupedColwiseParallel`). Kimi's low-rank gate down-projections stay whole (the
    up-projection's style sums their output's gradient). The depthwise convolution keeps its few weights per channel
    whole and convolves this rank's channels, their gradient summed over tp; ``A_log`` and ``dt_bias`` (per head, or
    per channel) are split with the heads; the gated norm's weight, shared by every head, stays whole with its
    gradient summed. A child or parameter outside that layout is refused.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp, heads = device_mesh.size(), _Heads.of(module)
        if heads.keys % tp or heads.values % tp:
            raise ValueError(
                f"DeltaRuleMixerParallel: {heads.keys} key and {heads.values} value heads do not split over tp={tp}."
            )
        columns, output, norms = _layout(module, heads=heads)
        self._project(module, device_mesh, columns, output=output)
        conv_blocks = Blocks((heads.key_width, heads.key_width, heads.value_width), (False,) * 3)
        self._distribute(module.conv1d, own_parameters(module.conv1d), device_mesh, Replicate())
        parts = [(module.conv1d, None, partial(channels_of, conv_blocks))]
        for norm in norms:
            self._distribute(norm, own_parameters(norm), device_mesh, Replicate())
            parts.append((norm, None, partial(_whole_summed, mesh=device_mesh)))
        for owner in _owners(module):
            parts += self._split_by_head(owner, device_mesh, heads=heads)
            localize_sizes(owner, {name: getattr(owner, name) // tp for name in _SIZES if hasattr(owner, name)})
        self._run_locally(module, {}, parts)
        return module

    def _split_by_head(self, owner: nn.Module, device_mesh: DeviceMesh, *, heads: _Heads) -> list[tuple]:
        """Split the decay parameters of ``owner`` (the mixer or its forget gate) by head; the local parts to use."""
        names = own_parameters(owner)
        for name in names:
            dim = _head_dim(getattr(owner, name), heads=heads)
            if dim is None:
                raise ValueError(
                    f"DeltaRuleMixerParallel: {type(owner).__name__}.{name} {tuple(getattr(owner, name).shape)} has"
                    f" no dimension of one entry per value head ({heads.values}) or channel ({heads.value_width})."
                )
            self._distribute(owner, (name,), device_mesh, Shard(dim))
        return [(owner, names, DTensor.to_local)] if names else []


def _owners(module: nn.Module) -> list[nn.Module]:
    """The mixer, and its forget gate where it has one (Kimi's): the modules holding sizes and decay parameters."""
    gate = getattr(module, "forget_gate", None)
    return [module] if gate is None else [module, gate]


def _head_dim(param: torch.Tensor, *, heads: _Heads) -> int | None:
    """The dimension of a decay parameter with one entry per value head or per value channel (heads major)."""
    return next((dim for dim, size in enumerate(param.shape) if size in (heads.values, heads.value_width)), None)


def _whole_summed(param: DTensor, *, mesh: DeviceMesh) -> torch.Tensor:
    """A replicated parameter every rank uses for its own heads: whole, its gradient summed over tp."""
    return summed_gradient(param.to_local(), mesh=mesh)


def _layout(module: nn.Module, *, heads: _Heads) -> tuple[dict[str, ParallelStyle], str, list[nn.Module]]:
    """The mixer's column-parallel projections by path, its output projection's name and its gated norms, or a refusal
    naming a child outside that layout."""
    widths = {name: heads.key_width for name in _KEY_WIDE} | {name: heads.value_width for name in _VALUE_WIDE}
    widths |= {name: heads.values for name in _PER_HEAD}
    # Qwen3-Next's fused [q; k; v; z] and [b; a], laid out key head by key head
    widths |= {"in_proj_qkvz": 2 * (heads.key_width + heads.value_width), "in_proj_ba": 2 * heads.values}
    packed = (heads.key_width, heads.key_width, heads.value_width)
    widths[_PACKED_QKV] = sum(packed)
    head_width = heads.value_width // heads.values
    columns: dict[str, ParallelStyle] = {}
    norms, output = [], None
    for path, child in module.named_modules():
        if child in (*_owners(module), module.conv1d):  # their parameters are split by head, or whole by channel
            continue
        name, own = path.rpartition(".")[2], list(child.parameters(recurse=False))
        linear = isinstance(child, nn.Linear)
        if linear and widths.get(name) == child.out_features:
            columns[path] = _column_style(name, packed=packed)
        elif linear and name in _OUTPUT and child.in_features == heads.value_width:
            output = path
        elif own and not linear and all(p.ndim == 1 and p.shape[0] == head_width for p in own):
            norms.append(child)  # the gated norm over one head's width
        elif own and not (linear and name in _LOW_RANK):
            raise ValueError(
                f"DeltaRuleMixerParallel: {type(module).__name__}.{path} ({type(child).__name__}) is not part of the"
                " gated delta rule's layout this style splits (see docs/layouts_by_structure.md). Use tp=1 for"
                " this model, or pass tp_plan= with styles of your own."
            )
    if output is None:
        raise ValueError(f"DeltaRuleMixerParallel: {type(module).__name__} has no output projection from its values.")
    return columns, output, norms


def _column_style(name: str, *, packed: tuple[int, ...]) -> ParallelStyle:
    if name != _PACKED_QKV:
        return ColwiseParallel()
    if len(set(packed)) == 1:
        return PackedColwiseParallel(parts=len(packed))
    return RegroupedColwiseParallel(block_sizes=packed)
