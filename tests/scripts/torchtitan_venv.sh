#!/usr/bin/env bash
# The torchtitan adapter's test environment (tests/integration/test_integrations_torchtitan.py):
# .venv-torchtitan, with torch (the same pin as .venv), rankscope and the torchtitan-test extra.
# A venv of its own because torchtitan 0.3.0's datasets<4.8 needs a huggingface_hub older than the
# one the dev extra's transformers needs (pyproject.toml). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
[ -x .venv-torchtitan/bin/python ] || "$PYTHON" -m venv .venv-torchtitan
.venv-torchtitan/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv-torchtitan/bin/python -m pip install -q --disable-pip-version-check -e ".[torchtitan-test]"
