#!/bin/bash
# rankscope Slurm epilog: the pair of prolog.sh. Removes this job's marker,
# the job's metrics directory (/dev/shm/rankscope-<job>, see train.sbatch),
# and the node's file_sd target once no rankscope job is left on the node.
#
# A failing epilog drains the node, so this script never fails.
# Same settings as prolog.sh.

[[ -r /etc/default/rankscope ]] && . /etc/default/rankscope

SD_DIR=${RANKSCOPE_SD_DIR:-/shared/prometheus/file_sd/rankscope}
STATE_DIR=${RANKSCOPE_STATE_DIR:-/run/rankscope/slurm-jobs}
SHM_PREFIX=${RANKSCOPE_SHM_PREFIX:-/dev/shm/rankscope-}
NODE=${SLURMD_NODENAME:-$(hostname -s)}

log() { logger -t rankscope-epilog -- "$*" 2>/dev/null || echo "rankscope-epilog: $*" >&2; }

unregister() {
    local job=${SLURM_JOB_ID:?SLURM_JOB_ID is not set}
    [[ "$job" =~ ^[0-9_]+$ ]] || { log "unexpected SLURM_JOB_ID '$job'"; return 1; }
    [[ "$NODE" =~ ^[A-Za-z0-9._-]+$ ]] || { log "refusing unusual node name '$NODE'"; return 1; }
    rm -rf -- "${SHM_PREFIX}${job}"
    [[ -d "$STATE_DIR" ]] || return 0
    (
        flock 9 || exit 1
        rm -f -- "$STATE_DIR/$job"
        # Other jobs still on this node keep the target.
        if [[ -z "$(find "$STATE_DIR" -mindepth 1 -maxdepth 1 -not -name '.lock' -print -quit)" ]]; then
            rm -f -- "$SD_DIR/$NODE.json"
        fi
    ) 9> "$STATE_DIR/.lock"
}

unregister || log "could not unregister $NODE for job ${SLURM_JOB_ID:-?}"
exit 0
