#!/usr/bin/env bash
# Creates .venv in the repository and installs rankscope into it (idempotent).
# torch is pinned to 2.13.0: on the project's machines that is a local CPU wheel;
# elsewhere pip fetches it from PyPI (use the CPU index to avoid the CUDA build:
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
extras=${1:-}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".${extras:+[$extras]}"
