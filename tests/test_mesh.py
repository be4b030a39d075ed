import functools

import pytest
from mesh_checks import check_mesh_axes

from lightning_automodel import ParallelDims
from lightning_automodel.testing.harness import run_checks


@pytest.mark.parametrize(
    ("request_", "world_size", "expected"),
    [
        (dict(), 4, (1, 1, 4, 1, 1)),
        (dict(tp=2), 8, (1, 1, 4, 1, 2)),
        (dict(tp=2, dp_replicate=2), 8, (1, 2, 2, 1, 2)),
        (dict(tp=2, cp=2, pp=2), 16, (2, 1, 2, 2, 2)),
        (dict(tp=4, dp_shard=2), 8, (1, 1, 2, 1, 4)),
        (dict(tp=8), 8, (1, 1, 1, 1, 8)),
    ],
)
def test_dp_shard_inferred(request_, world_size, expected):
    dims = ParallelDims(**request_).resolve(world_size)
    assert dims.shape == expected
    assert dims.world_size == world_size
    assert dims.dp == expected[1] * expected[2]


@pytest.mark.parametrize(
    ("request_", "world_size", "fragments"),
    [
        (dict(tp=3), 4, ["tp=3", "4 processes", "does not divide 4", "valid tp sizes are [1, 2, 4]"]),
        (
            dict(tp=2, dp_shard=4),
            4,
            ["needs pp*dp_replicate*dp_shard*cp*tp = 8", "world size is 4", 'dp_shard="auto" (= 2)'],
        ),
        (dict(tp=2, dp_shard=1), 4, ["= 2 processes", 'dp_shard="auto" (= 2) or dp_shard=2']),
        (dict(dp_replicate=3, tp=2), 8, ["dp_replicate=3", "does not divide 8", "pp=1, dp_replicate=1, cp=1, tp=1"]),
        (dict(pp=2, cp=2, tp=2), 4, ["pp*dp_replicate*cp*tp = 8 does not divide 4"]),
    ],
)
def test_sizes_that_cannot_tile_the_world_are_named(request_, world_size, fragments):
    with pytest.raises(ValueError) as error:
        ParallelDims(**request_).resolve(world_size)
    for fragment in fragments:
        assert fragment in str(error.value)


@pytest.mark.parametrize(
    ("request_", "fragment"),
    [
        (dict(tp=0), "tp=0 is invalid: tp must be a positive integer"),
        (dict(dp_replicate=-1), "dp_replicate=-1 is invalid"),
        (dict(dp_shard="all"), "dp_shard='all' is invalid: dp_shard must be a positive integer or \"auto\""),
        (dict(cp=1.5), "cp=1.5 is invalid"),
        (dict(pp=True), "pp=True is invalid"),
    ],
)
def test_malformed_sizes_are_rejected(request_, fragment):
    with pytest.raises(ValueError, match="is invalid") as error:
        ParallelDims(**request_)
    assert fragment in str(error.value)


def test_unresolved_dims_have_no_shape():
    with pytest.raises(RuntimeError, match="resolve"):
        _ = ParallelDims().shape


@pytest.mark.parametrize(
    ("request_", "world_size", "fragments"),
    [
        (dict(ep=3), 4, ["ep=3 does not fit", "dp_shard*cp = 4", "Valid ep sizes here: [1, 2, 4]"]),
        (dict(ep=4, tp=2), 4, ["ep=4", "dp_shard*cp = 2", "tp peers read the same ones", "[1, 2]"]),
        (dict(ep=2, dp_shard=1, dp_replicate=2), 2, ["dp_shard*cp = 1", "Valid ep sizes here: [1]"]),
    ],
)
def test_expert_parallel_sizes_borrowed_from_dp_shard_times_cp(request_, world_size, fragments):
    with pytest.raises(ValueError) as error:
        ParallelDims(**request_).resolve(world_size)
    for fragment in fragments:
        assert fragment in str(error.value)
    assert ParallelDims(ep=2, tp=2).resolve(8).efsdp == 2


def test_mesh_groups_and_timeouts_on_four_ranks():
    """tp is the innermost axis; flattened axes group the right ranks; every group has the requested timeout; ep
    takes neighbouring ranks of dp_shard x cp and efsdp the rest."""
    checks = [functools.partial(check_mesh_axes, *sizes) for sizes in ((1, 2), (2, 2), (1, 1, 2), (1, 2, 2))]
    results = run_checks(4, checks)
    tp_dp = results["check_mesh_axes(1, 2)"]
    assert [r["tp"] for r in tp_dp] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp"] for r in tp_dp] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert tp_dp[0]["dp_cp"] == tp_dp[0]["dp_shard_cp"] == [0, 2]
    assert tp_dp[0]["fsdp_axes"] == ("dp_shard_cp",)
    hsdp = results["check_mesh_axes(2, 2)"]
    assert [r["dp_replicate"] for r in hsdp] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["dp_shard"] for r in hsdp] == [[0], [1], [2], [3]]
    assert [r["dp"] for r in hsdp] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert hsdp[0]["fsdp_axes"] == ("dp_replicate", "dp_shard_cp")
    experts = results["check_mesh_axes(1, 1, 2)"]
    assert [r["ep"] for r in experts] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["efsdp"] for r in experts] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert experts[0]["experts_axes"] == (("efsdp",), ("ep",))
    with_tp = results["check_mesh_axes(1, 2, 2)"]
    assert [r["ep"] for r in with_tp] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["efsdp"] for r in with_tp] == [[0], [1], [2], [3]]
    assert with_tp[0]["experts_axes"] == (("efsdp",), ("ep", "tp"))
