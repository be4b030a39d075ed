#!/usr/bin/env bash
# Create .venv with the package and its test, docs and lint dependencies. VENV, TORCH_VERSION and EXTRAS choose
# another (CI also builds .venv-torch2.11: VENV=.venv-torch2.11 TORCH_VERSION=2.11.0 EXTRAS=test).
#
# torch is installed first and on its own: with torch 2.13.0 already present, the other requirements do not
# pull a newer CUDA build (several GB). On a CPU-only machine without a local torch wheel, set
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu to take the CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    "$VENV/bin/python" -m pip install --quiet "torch==${TORCH_VERSION:-2.13.0}" --index-url "$TORCH_INDEX_URL"
else
    "$VENV/bin/python" -m pip install --quiet "torch==${TORCH_VERSION:-2.13.0}"
fi
"$VENV/bin/python" -m pip install --quiet -e ".[${EXTRAS:-test,docs,lint}]"
