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
# pip takes ~10 s to find that nothing changed: skip it while pyproject.toml and the extras are
# what the last install had and rankscope still imports.
stamp=".venv/.rankscope-installed-${extras:-base}"
want="$(sha256sum pyproject.toml | cut -d' ' -f1) torch==2.13.0"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && .venv/bin/python -c "import rankscope" 2>/dev/null; then
    exit 0
fi
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".${extras:+[$extras]}"
echo "$want" > "$stamp"
