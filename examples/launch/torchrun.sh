#!/usr/bin/env bash
# Multi-node with torchrun: run this on every node. torchrun starts one process per GPU and hands Lightning
# the ranks (TorchElasticEnvironment); the c10d rendezvous needs only the head node's address.
#
#   HEAD_NODE=node-0 NUM_NODES=4 bash examples/launch/torchrun.sh examples/hsdp_multinode.yaml
set -euo pipefail
CONFIG=${1:?usage: torchrun.sh CONFIG.yaml}
torchrun \
    --nnodes="${NUM_NODES:?}" \
    --nproc-per-node="${GPUS_PER_NODE:-8}" \
    --rdzv-backend=c10d \
    --rdzv-endpoint="${HEAD_NODE:?}:${PORT:-29500}" \
    --rdzv-id="${JOB_ID:-lightning-automodel}" \
    -m lightning_automodel.cli fit --config "$CONFIG" \
    --trainer.num_nodes="$NUM_NODES" --trainer.devices="${GPUS_PER_NODE:-8}"
