#!/bin/bash
# rankscope Slurm prolog: register this node as a Prometheus file_sd target.
#
# slurm.conf (on every node):   Prolog=/etc/slurm/rankscope-prolog.sh
#                               Epilog=/etc/slurm/rankscope-epilog.sh
# Prometheus reads $RANKSCOPE_SD_DIR/*.json (deploy/slurm/prometheus.yml).
#
# One file per node, <node>.json, holding the node's exporter. Jobs that share
# a node share the file: each job leaves a marker in $RANKSCOPE_STATE_DIR and
# the epilog removes the file only when the last job on the node ends.
#
# A failing prolog drains the node, so this script never fails: a problem is
# logged (syslog, tag rankscope-prolog) and the job starts anyway.
#
# Settings (environment, e.g. from /etc/default/rankscope sourced below):
#   RANKSCOPE_SD_DIR       shared directory Prometheus watches (default /shared/prometheus/file_sd/rankscope)
#   RANKSCOPE_STATE_DIR    node-local marker directory (default /run/rankscope/slurm-jobs)
#   RANKSCOPE_PORT         exporter port (default 9400)
#   RANKSCOPE_TARGET_HOST  address Prometheus scrapes (default: the node's FQDN)

[[ -r /etc/default/rankscope ]] && . /etc/default/rankscope

SD_DIR=${RANKSCOPE_SD_DIR:-/shared/prometheus/file_sd/rankscope}
STATE_DIR=${RANKSCOPE_STATE_DIR:-/run/rankscope/slurm-jobs}
PORT=${RANKSCOPE_PORT:-9400}
NODE=${SLURMD_NODENAME:-$(hostname -s)}
TARGET_HOST=${RANKSCOPE_TARGET_HOST:-$(hostname -f)}
CLUSTER=${SLURM_CLUSTER_NAME:-}

log() { logger -t rankscope-prolog -- "$*" 2>/dev/null || echo "rankscope-prolog: $*" >&2; }

register() {
    local job=${SLURM_JOB_ID:?SLURM_JOB_ID is not set}
    # Names end up in JSON and in file names: accept only what host names use.
    local name
    for name in "$NODE" "$TARGET_HOST" "$CLUSTER"; do
        [[ "$name" =~ ^[A-Za-z0-9._-]*$ ]] || { log "refusing unusual name '$name'"; return 1; }
    done
    [[ "$PORT" =~ ^[0-9]+$ ]] || { log "RANKSCOPE_PORT='$PORT' is not a port"; return 1; }

    mkdir -p "$STATE_DIR" "$SD_DIR" || return 1
    (
        flock 9 || exit 1
        : > "$STATE_DIR/$job" || exit 1
        # Target labels only; `node` is already on every series the exporter
        # serves (a target label of the same name would rename it).
        local labels="{}"
        [[ -n "$CLUSTER" ]] && labels="{\"slurm_cluster\": \"$CLUSTER\"}"
        local tmp
        tmp=$(mktemp "$SD_DIR/.$NODE.json.XXXXXX") || exit 1
        printf '[{"targets": ["%s:%s"], "labels": %s}]\n' "$TARGET_HOST" "$PORT" "$labels" > "$tmp" &&
            chmod 0644 "$tmp" &&
            mv -f "$tmp" "$SD_DIR/$NODE.json"   # rename: Prometheus never reads a half-written file
    ) 9> "$STATE_DIR/.lock"
}

register || log "could not register $NODE for job ${SLURM_JOB_ID:-?} in $SD_DIR"
exit 0
