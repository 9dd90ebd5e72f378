"""Who this rank is: read once at start-up from the launcher's environment.

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE and
TORCHELASTIC_RUN_ID; Slurm (srun) sets SLURM_PROCID, SLURM_LOCALID,
SLURM_NTASKS and SLURM_JOB_ID; Kubeflow's PyTorchJob runs torchrun (PET_*
variables) in pods whose name is HOSTNAME.

The run id is what every rank of one job agrees on and two jobs running at
once do not share, whatever the launcher, first found of:

1. ``Monitor(run=...)`` / ``RANKSCOPE_RUN``;
2. torchrun's rendezvous id (``--rdzv-id``; ``--standalone`` makes a random one);
3. the scheduler's job: ``SLURM_JOB_ID``, ``JOB_NAME``;
4. the job's rendezvous endpoint, ``MASTER_ADDR:MASTER_PORT``: torchrun with
   static rendezvous (``--master-addr/--master-port``, whose run id is
   "none"), ``mp.spawn`` and hand-set variables. Two jobs that run at once
   cannot share one endpoint; a later job on the same endpoint is a relaunch
   of the run, whose counts start again from 0;
5. ``default``.

A second live job on one node that still lands on a run id in use is caught
when the Monitor starts (rankscope.publishing.startup.claim_run).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from rankscope.contract.environment import ConfigError, default_node, env_value


@dataclass(frozen=True)
class RankIdentity:
    run: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node: str
    slurm_job_id: str = ""
    k8s_pod: str = ""

    @property
    def labels(self) -> dict[str, str]:
        """The identity labels every rank series carries."""
        return {"run": self.run, "rank": str(self.rank), "local_rank": str(self.local_rank), "node": self.node}

    @classmethod
    def from_env(cls, run: str | None = None, env: Mapping[str, str] | None = None) -> "RankIdentity":
        env = os.environ if env is None else env
        rank = env_value(env, ("RANK", "SLURM_PROCID"), int, 0)
        world = env_value(env, ("WORLD_SIZE", "SLURM_NTASKS"), int, 1)
        if rank and not (env.get("WORLD_SIZE") or env.get("SLURM_NTASKS")):
            raise ConfigError(f"RANK={rank} is set but WORLD_SIZE is not: a launcher sets both (torchrun, srun); "
                              "set WORLD_SIZE to the number of ranks")
        local_rank = env_value(env, ("LOCAL_RANK", "SLURM_LOCALID"), int, 0)
        local_world = env_value(env, ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"), int, world)
        if not 0 <= rank < world:
            raise ConfigError(f"RANK={rank} is outside WORLD_SIZE={world}")
        if not 0 <= local_rank < max(local_world, 1):
            raise ConfigError(f"LOCAL_RANK={local_rank} is outside LOCAL_WORLD_SIZE={local_world}")
        slurm_job = env.get("SLURM_JOB_ID", "")
        pod = env.get("POD_NAME", "") or (env.get("HOSTNAME", "") if "KUBERNETES_SERVICE_HOST" in env else "")
        run_id = (run or env.get("RANKSCOPE_RUN") or _elastic_run_id(env) or slurm_job or env.get("JOB_NAME")
                  or _rendezvous_endpoint(env) or "default")
        node = default_node(env)
        return cls(run=run_id, rank=rank, local_rank=local_rank, world_size=world,
                   local_world_size=local_world, node=node, slurm_job_id=slurm_job, k8s_pod=pod)


def _elastic_run_id(env: Mapping[str, str]) -> str:
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    return "" if run_id in ("", "none") else run_id


def _rendezvous_endpoint(env: Mapping[str, str]) -> str:
    addr, port = env.get("MASTER_ADDR", "").strip(), env.get("MASTER_PORT", "").strip()
    return f"{addr}:{port}" if addr and port else ""

