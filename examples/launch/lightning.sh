#!/usr/bin/env bash
# Multi-node with Lightning's own launcher: run the same command on every node, each with its NODE_RANK.
# On each node Lightning starts one process per device itself; MASTER_ADDR/MASTER_PORT name node 0.
#
#   MASTER_ADDR=node-0 NODE_RANK=0 NUM_NODES=4 bash examples/launch/lightning.sh examples/hsdp_multinode.yaml
#   MASTER_ADDR=node-0 NODE_RANK=1 NUM_NODES=4 bash examples/launch/lightning.sh examples/hsdp_multinode.yaml
#   ...
set -euo pipefail
CONFIG=${1:?usage: lightning.sh CONFIG.yaml}
export MASTER_ADDR=${MASTER_ADDR:?} MASTER_PORT=${MASTER_PORT:-29500} NODE_RANK=${NODE_RANK:?}
lightning-automodel fit --config "$CONFIG" \
    --trainer.num_nodes="${NUM_NODES:?}" --trainer.devices="${GPUS_PER_NODE:-8}"
