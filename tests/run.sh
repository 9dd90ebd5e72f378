#!/usr/bin/env bash
# The test suite on a fresh machine: Debian's Prometheus/Alertmanager (when
# missing and we are root), the project with its dev extras, then pytest.
#
#   bash tests/run.sh [PYTEST ARGS]          # every tier but the fault matrix (what .ci/run runs)
#   bash tests/run.sh --fast [PYTEST ARGS]   # the fast tier, tests/unit (pytest -m "not integration" is the same)
#   bash tests/run.sh --matrix [PYTEST ARGS] # the fault matrix only (tests/drills; ~16 min; not in the full run)
#   bash tests/run.sh --soak [PYTEST ARGS]   # the 30-minute noisy healthy run at the production settings
#                                            # (tests/drills/test_healthy_run.py; ~32 min; in neither)
#
# Both tiers need promtool and amtool (the fast tier's static rule and routing
# checks), so both install the Debian packages. Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
tier=(-m "not matrix and not soak")
full=1
if [ "${1:-}" = "--fast" ]; then
    shift
    tier=(-m "not integration and not matrix and not soak")
    full=0
elif [ "${1:-}" = "--matrix" ]; then
    shift
    tier=(-m matrix)
    full=0
elif [ "${1:-}" = "--soak" ]; then
    shift
    tier=(-m soak)
    full=0
fi
# victoria-metrics (vmagent, vmalert): tests/integration/test_scale_victoriametrics.py (issue 16).
if ! command -v promtool >/dev/null || ! command -v prometheus-alertmanager >/dev/null \
        || ! command -v amtool >/dev/null || ! command -v vmagent >/dev/null; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            prometheus prometheus-alertmanager victoria-metrics >/dev/null
    else
        echo "tests need Debian's prometheus, prometheus-alertmanager and victoria-metrics: sudo apt-get install prometheus prometheus-alertmanager victoria-metrics" >&2
        exit 1
    fi
fi
# The full run's console tests (issue 18): `rankscope top` in a real terminal (tmux) and the
# report rendered by a real browser (Debian's chromium). The fast tier and the matrix use neither.
if [ "$full" = 1 ] && { ! command -v tmux >/dev/null || ! command -v chromium >/dev/null; }; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends tmux chromium >/dev/null \
            || echo "warning: could not install tmux and chromium; the console tests that need them are skipped" >&2
    else
        echo "note: without tmux and chromium (sudo apt-get install tmux chromium) the console tests that need them are skipped" >&2
    fi
fi
bash deploy/local/setup.sh dev
# The full run's torchtitan adapter test: torchtitan in a venv of its own (~100 s to make; pyproject.toml).
if [ "$full" = 1 ]; then
    bash tests/scripts/torchtitan_venv.sh
    export RANKSCOPE_REQUIRE_TORCHTITAN=1
fi
exec .venv/bin/python -m pytest -q --durations=25 "${tier[@]}" "$@"
