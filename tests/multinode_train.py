"""One rank of the multi-node test (test_multinode.py starts it with torchrun: 2 launchers of 2 processes).

Nothing here sets ranks or addresses: Lightning must find them in the torchrun environment itself, as it would on
real nodes. Each rank trains the tiny Llama at dp_replicate=2 x tp=2 through a real Trainer, compares every step
with a single-process run, checks what it can see of the layout, and writes what it measured to
``OUT_DIR/rank<global rank>.json`` for the test to cross-check over all ranks.

Usage: multinode_train.py OUT_DIR. The helpers it shares with the tests come from lightning_automodel.testing.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import TorchElasticEnvironment

from lightning_automodel import AutoModelParallelStrategy
from lightning_automodel.testing.models import tiny_model
from lightning_automodel.testing.parity import STEPS
from lightning_automodel.testing.trainer_parity import CausalLM, compare_training, data, reference_run

NODES = 2
PROCESSES_PER_NODE = 2
DP_REPLICATE = NODES  # one replica per node: only the gradient all-reduce crosses nodes
TP = PROCESSES_PER_NODE  # tensor-parallel peers within a node


def initial_difference(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    """How far this rank's freshly built weights are from rank 0's: 0 on rank 0, large elsewhere, so weights
    that end up in parity can only have come from rank 0's broadcast."""
    ref_params = dict(reference.named_parameters())
    return max((p - ref_params[name]).abs().max().item() for name, p in model.named_parameters())


def group_ranks(strategy: AutoModelParallelStrategy, dim: str) -> list[int]:
    return sorted(dist.get_process_group_ranks(strategy.device_mesh[dim].get_group()))


def check_layout(strategy: AutoModelParallelStrategy) -> dict[str, list[int]]:
    """The environment Lightning detected, and a mesh whose replicas span the nodes and whose tp groups don't."""
    environment = strategy.cluster_environment
    assert isinstance(environment, TorchElasticEnvironment), type(environment)
    sizes = (strategy.world_size, strategy.num_nodes)
    assert sizes == (NODES * PROCESSES_PER_NODE, NODES), f"(world size, nodes) = {sizes}"
    assert strategy.node_rank == int(os.environ["GROUP_RANK"]), (strategy.node_rank, os.environ["GROUP_RANK"])
    assert strategy.global_rank == dist.get_rank() == int(os.environ["RANK"]), (strategy.global_rank, dist.get_rank())
    node_of = [None] * dist.get_world_size()
    dist.all_gather_object(node_of, strategy.node_rank)  # which node each global rank really runs on
    groups = {dim: group_ranks(strategy, dim) for dim in ("dp_replicate", "tp")}
    nodes = {dim: [node_of[r] for r in ranks] for dim, ranks in groups.items()}
    assert sorted(nodes["dp_replicate"]) == list(range(NODES)), f"replicas {groups} must be one per node: {nodes}"
    assert len(set(nodes["tp"])) == 1, f"tp peers {groups} must share a node: {nodes}"
    return groups


def main(out_dir: Path) -> None:
    seed = int(os.environ["RANK"])  # every rank a different seed: rank 0's weights must win
    module = CausalLM(tiny_model(seed=seed))
    reference = tiny_model()
    difference = initial_difference(module.model, reference)
    strategy = AutoModelParallelStrategy(dp_replicate=DP_REPLICATE, tp=TP, timeout=timedelta(seconds=60))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=PROCESSES_PER_NODE,
        num_nodes=NODES,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, data(DP_REPLICATE))  # the data-parallel degree: dp_shard is 1
    groups = check_layout(strategy)
    errors = compare_training(module, reference, reference_run(reference))
    result = {
        "launcher": os.environ["MULTINODE_LAUNCHER"],
        "node_rank": strategy.node_rank,
        "global_rank": strategy.global_rank,
        "seed": seed,
        "initial_difference": difference,
        "errors": errors,
        "groups": groups,
    }
    (out_dir / f"rank{strategy.global_rank}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    # The results are written: skip the interpreter's teardown of torch and transformers (native code, ~5 s of a
    # ~20 s test with 4 processes on 2 cores). Lightning leaves the process group up anyway.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
