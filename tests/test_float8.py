"""Float8 training (``float8=``): the decoder blocks' linear layers converted by torchao (emulated on CPU), through a
real Trainer against the same model converted in one process (see float8_checks): rowwise scaling at tp=2 + sp x
dp_shard=2 with activation checkpointing and compiled blocks; tensorwise with FSDP2's float8 all-gather under pp=2 x
dp_shard=2, every such weight's scale computed after each optimizer step; the layers kept in high precision named;
the options and devices refused."""

from __future__ import annotations

import re
from functools import partial

import pytest
import torch
import torch.distributed as dist
from float8_checks import check_float8_trainer_parity

from lightning_automodel import AutoModelParallelStrategy, ParallelDims
from lightning_automodel.hf.decoder_layers import named_decoder_layers
from lightning_automodel.parallel.float8 import Float8Options, float8_layers
from lightning_automodel.planning.report import plan_report
from lightning_automodel.testing.harness import run_checks
from lightning_automodel.testing.models import tiny_model


def test_float8_trains_as_one_process_converted():
    checks = [
        partial(check_float8_trainer_parity, tp=2, sp=True, recipe="rowwise"),
        partial(check_float8_trainer_parity, pp=2),
        partial(
            check_float8_trainer_parity,
            tp=2,
            sp=True,
            recipe="rowwise",
            activation_checkpointing=True,
            compile={"backend": "aot_eager"},
        ),
        check_float8_refusals,  # in this launch: a launch of its own cost more than the check
    ]
    results = run_checks(4, checks, timeout=600)
    tp_sp, pp, compiled, _ = (results[name] for name in results)
    assert all(rank["float8_all_gather"] for rank in pp), pp  # tensorwise over dp_shard=2: FSDP2 gathers in float8
    assert all(rank["scales_precomputed"] for rank in pp), pp  # after each optimizer step, in one all-reduce
    assert all(not rank["float8_all_gather"] for rank in tp_sp), tp_sp  # rowwise: in high precision
    assert [rank["float8_layers_here"] for rank in pp] == [7, 7, 14, 14], (
        pp
    )  # ranks 0, 1: stage 0 (a block), 2, 3: stage 1


def test_layers_kept_in_high_precision_are_named():
    model = tiny_model(intermediate_size=72)  # gate and up: 72 x 64, down: 64 x 72
    blocks = named_decoder_layers(model)
    options = Float8Options(skip=("model.layers.*.self_attn.o_proj",))
    found = float8_layers(model, blocks, options, tp_styles={}, tp=1)
    assert sorted({name.rpartition(".")[2] for name in found.converted}) == ["k_proj", "q_proj", "v_proj"], found
    assert found.kept["model.layers.0.self_attn.o_proj"] == "named in float8 skip", found.kept
    assert found.kept["model.layers.1.mlp.down_proj"] == "its weight is 64 x 72, not multiples of 16", found.kept
    assert "6 linear layers in float8, 8 kept in high precision" in found.summary(), found.summary()


def test_the_plan_report_lists_the_layers_float8_converts_and_keeps():
    with torch.device("meta"):
        model = tiny_model(intermediate_size=96)  # at tp=2: gate and up 48 x 64 a rank, down 64 x 48
    report = plan_report(model, ParallelDims(tp=2).resolve(2), float8={"recipe": "rowwise"})
    text = str(report)
    assert "float8 (rowwise scaling): 14 linear layers, 0 kept in high precision" in text, text
    with torch.device("meta"):
        model = tiny_model(intermediate_size=72)  # at tp=2: 36 a rank
    text = str(plan_report(model, ParallelDims(tp=2).resolve(2), float8=True))
    assert "float8 (tensorwise scaling): 8 linear layers, 6 kept in high precision" in text, text
    assert re.search(r"model.layers.\*.mlp.down_proj +kept x2: its weight is 64 x 36 on each tp rank", text), text
    assert re.search(r"model.layers.\*.self_attn.q_proj +float8 x2", text), text


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(float8={"recipe": "blockwise"}), "use 'tensorwise' or 'rowwise'"),
        (dict(float8={"emulated": True}), "emulated not among its options"),
        (dict(float8="yes"), "use False, True or a dict"),
    ],
)
def test_float8_options_refused(options, message):
    with pytest.raises(ValueError, match=message):
        AutoModelParallelStrategy(**options)


def check_float8_refusals() -> None:
    """Each refused before any collective; the meshes are built first and the ranks leave together, so that no rank
    is still creating a group when another has gone (with the store it hosted)."""
    from lightning_automodel.parallel import parallelize

    cases = [
        (dict(tp=2), dict(float8=True), "cpu has no float8 matmuls"),
        (dict(tp=2), dict(float8={"emulate": True}), "gloo \\(CPU\\) has no float8 collectives"),
        (dict(), dict(float8={"emulate": True, "skip": ("model.layers.*.*.*",)}), "converts no linear layer"),
    ]
    meshes = [ParallelDims(**dims).resolve(dist.get_world_size()).build_mesh("cpu") for dims, _, _ in cases]
    for mesh, (_, options, message) in zip(meshes, cases, strict=True):
        with pytest.raises(ValueError, match=message):
            parallelize(tiny_model(), mesh, **options)
    dist.barrier()
