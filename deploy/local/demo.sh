#!/usr/bin/env bash
# The demo: a real 2-rank DDP job with live /metrics on 127.0.0.1:${PORT:-9400}.
# If Debian's prometheus and prometheus-alertmanager are installed, they are
# started next to it on 127.0.0.1 (fast rule thresholds, so alerts fire within
# seconds) and stopped when the job ends. Extra arguments go to the trainer,
# e.g. a fault:  deploy/local/demo.sh --hang-at 300
set -euo pipefail
cd "$(dirname "$0")/../.."
bash deploy/local/setup.sh
PORT=${PORT:-9400}              # the node exporter's /metrics
PROM_PORT=${PROM_PORT:-9090}
AM_PORT=${AM_PORT:-9093}
STEPS=${STEPS:-2000}
pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap cleanup EXIT
if command -v prometheus >/dev/null && command -v prometheus-alertmanager >/dev/null; then
    work=$(mktemp -d /tmp/rankscope-demo.XXXXXX)
    .venv/bin/python -m prometheus.generate --override prometheus/fast.yaml --out "$work/rules" >/dev/null
    sed "s|rules/|$work/rules/|; s|15s|2s|g; s|127.0.0.1:9400|127.0.0.1:$PORT|; s|127.0.0.1:9093|127.0.0.1:$AM_PORT|" \
        prometheus/prometheus.yml \
        > "$work/prometheus.yml"
    prometheus-alertmanager --config.file=prometheus/alertmanager.yml --storage.path="$work/am" \
        --web.listen-address=127.0.0.1:$AM_PORT --cluster.listen-address= >"$work/alertmanager.log" 2>&1 &
    pids+=($!)
    prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
        --web.listen-address=127.0.0.1:$PROM_PORT >"$work/prometheus.log" 2>&1 &
    pids+=($!)
    echo "Prometheus: http://127.0.0.1:$PROM_PORT/alerts   Alertmanager: http://127.0.0.1:$AM_PORT   (logs in $work)"
else
    echo "(install prometheus and prometheus-alertmanager to also get Prometheus and Alertmanager here)"
fi
echo "Node metrics: http://127.0.0.1:$PORT/metrics   (curl -s 127.0.0.1:$PORT/metrics | grep rankscope_step_)"
.venv/bin/torchrun --standalone --nproc-per-node 2 -m rankscope.train --steps "$STEPS" --metrics-port "$PORT" "$@"
