#!/usr/bin/env bash
# The GPU check in one command, on a machine with one NVIDIA GPU and no network, from the
# repository root with .whl/ carried along (bash tests/gpu/prepare.sh makes it):
#
#   bash tests/gpu/run.sh            # ~5 min (estimated); figures on stdout and in $OUT/gpu-check.json
#
# What it proves, and the figures of the last run: docs/performance.md, "On a GPU".
set -uo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv
python3 -c 'import torch, rankscope; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl",
torch.cuda.nccl.version(), "rankscope", rankscope.__file__)'
GPU_CHECK_OUT="$OUT/gpu-check.json" timeout 480 python3 -m pytest tests/gpu -m gpu -s -q -p no:cacheprovider \
    -o addopts="" -W ignore::DeprecationWarning 2>&1 | tee "$OUT/gpu-check.log"
