#!/usr/bin/env bash
# The test suite on a fresh machine: Debian's Prometheus/Alertmanager for the
# integration tests (when missing and we are root), the project with its dev
# extras, then pytest. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v promtool >/dev/null || ! command -v prometheus-alertmanager >/dev/null; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            prometheus prometheus-alertmanager >/dev/null
    else
        echo "tests need Debian's prometheus and prometheus-alertmanager: sudo apt-get install prometheus prometheus-alertmanager" >&2
        exit 1
    fi
fi
bash deploy/local/setup.sh dev
exec .venv/bin/python -m pytest -q "$@"
