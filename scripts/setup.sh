#!/usr/bin/env bash
# Create .venv with the package and its test, docs and lint dependencies.
#
# torch is installed first and on its own: with torch 2.13.0 already present, the other requirements do not
# pull a newer CUDA build (several GB). On a CPU-only machine without a local torch wheel, set
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu to take the CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    .venv/bin/python -m pip install --quiet "torch==${TORCH_VERSION:-2.13.0}" --index-url "$TORCH_INDEX_URL"
else
    .venv/bin/python -m pip install --quiet "torch==${TORCH_VERSION:-2.13.0}"
fi
.venv/bin/python -m pip install --quiet -e ".[test,docs,lint]"
