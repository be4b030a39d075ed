"""full_tensor's own gather of strided shards (torch 2.11's DTensor cannot): on this torch, which can, it equals
DTensor.full_tensor for every parameter of FSDP2 over tp (strided over dp_shard) and of Phi-3's fused q/k/v split part
by part at tp=4 (strided on one mesh dim) and at tp=2 x dp_shard=2 (on both)."""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_automodel import ParallelDims, parallelize
from lightning_automodel.parallel import full_tensor as gathering
from lightning_automodel.testing.harness import run_checks
from lightning_automodel.testing.models import tiny_model


def check_strided_gather(family: str, **dims: int) -> int:
    model = tiny_model(family)
    parallelize(model, ParallelDims(**dims).resolve(dist.get_world_size()).build_mesh("cpu"))
    strided = [p for p in model.parameters() if any(isinstance(q, _StridedShard) for q in p.placements)]
    assert strided, "no parameter is strided: the check would check nothing"
    gathering.GATHERS_STRIDED_SHARDS = False  # this process only: the gather torch 2.11 needs
    for param in model.parameters():
        assert isinstance(param, DTensor)
        torch.testing.assert_close(gathering.full_tensor(param), param.full_tensor(), rtol=0, atol=0)
    return len(strided)


def test_strided_shards_gathered_as_torch_gathers_them():
    results = run_checks(
        4,
        [
            partial(check_strided_gather, "llama", tp=2),
            partial(check_strided_gather, "phi3", tp=4),
            partial(check_strided_gather, "phi3", tp=2),  # strided on both mesh dims: FSDP2 over the packed parts
        ],
        timeout=240,
    )
    assert all(count > 0 for counts in results.values() for count in counts), results
