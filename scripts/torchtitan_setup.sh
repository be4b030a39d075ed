#!/usr/bin/env bash
# Install torchtitan 0.3.0 for benchmarks/torchtitan_peer.py into a directory of its own (default .torchtitan, or
# $1), then put that directory on PYTHONPATH. Everything goes in with --no-deps, so the venv's torch 2.13 is never
# replaced: torchtitan, the packages it imports at start-up, and what its imports pull in transitively (tensorboard
# for its metrics, datasets for its dataloaders). torchdata, tokenizers, safetensors and pillow come from .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET="${1:-.torchtitan}"
pip_install() { .venv/bin/python -m pip install --quiet --no-deps --target "$TARGET" "$@"; }
pip_install torchtitan==0.3.0
pip_install spmd_types==0.2.3 torch_checkpointing==0.1.1 tyro==1.0.17 einops==0.8.2 typeguard==4.6.1
pip_install tensorboard==2.21.0 protobuf==7.36.2 absl-py==2.5.1
pip_install datasets==4.7.0 pyarrow==26.0.1 pandas==3.1.1 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 \
    httpx==0.28.1 httpcore==1.0.9  # the versions it was measured with
echo "run with PYTHONPATH=$PWD:$TARGET"
