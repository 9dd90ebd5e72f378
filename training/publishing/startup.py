"""What a rank does once, at start-up: claim its run directory and describe itself.

* ``claim_run``: no other live job on this node uses the run id (two jobs'
  counts would add up in one run): a single-process job takes a run id of its
  own, a distributed one is refused with both jobs named.
* ``prepare_run_dir``: the run's directory is writable (or a ConfigError
  now), files of an earlier launch of the same run on this node are removed
  (or a re-run would add to its counters), and the rank's registration is
  written for the exporter.
* ``RankInfo``: the ``rankscope_rank_info`` series (device, GPU UUID,
  backend, versions). A Monitor may be created before
  ``init_process_group``, so the series is written once the backend is
  known, and only then: a second series with ``backend=""`` would break every
  join on rank_info.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any, Mapping, Protocol

from rankscope.contract.environment import ConfigError
from rankscope.contract.rundir import (Registration, load_registrations, process_start_ticks, remove_previous_launch,
                                       run_slug)
from rankscope.device.rank_device import RankDevice
from rankscope.identity import RankIdentity
from rankscope.publishing.metrics import RankMetrics

log = logging.getLogger("rankscope")


def launcher_pid(env: Mapping[str, str] | None = None) -> int:
    """The process that launched this rank and restarts it: torchrun's agent, else the rank itself.

    Files of an earlier process with the same launcher are a restart of this
    launch (kept, so counters continue); anything else dead is an earlier
    launch. Without torchelastic nothing restarts a rank: a shell that re-runs
    a script is not a launcher, and each run starts from zero.
    """
    env = os.environ if env is None else env
    return os.getppid() if "TORCHELASTIC_RESTART_COUNT" in env else os.getpid()


def claim_run(identity: RankIdentity, metrics_dir: Path) -> RankIdentity:
    """``identity``, unless another job that is still running uses its run id on this node.

    Ranks of one job never share a rank number; two jobs on one run id do. So another job
    is a live process registered in the run's directory as this rank, other than this
    process and not started by this rank's launcher (a torchelastic restart replaces its
    own workers). Whatever launched the ranks (torchrun, srun, mp.spawn, a framework's own
    launcher), its counts must not be mixed with this one's, and nothing it counted may be
    removed. A single-process job then takes a run id of its own, ``<run>-<pid>``, said once;
    a distributed job cannot (its ranks on other nodes would not follow) and is refused at
    start-up, naming both jobs."""
    run_dir = metrics_dir / run_slug(identity.run)
    if not run_dir.is_dir():
        return identity
    launcher = launcher_pid()
    ticks = process_start_ticks(launcher)
    others = [reg for reg in load_registrations(run_dir)
              if reg.rank == identity.rank and reg.pid != os.getpid() and reg.finished_at is None
              and not (reg.agent_pid == launcher and reg.agent_start_ticks == ticks) and reg.process_alive()]
    if not others:
        return identity
    other = others[0]
    described = (f"run {identity.run!r} on node {identity.node} is already used by a job that is still running "
                 f"(its rank {other.rank} is pid {other.pid}, launched by pid {other.agent_pid}, since "
                 f"{time.strftime('%H:%M:%S', time.localtime(other.started_at))})")
    if identity.world_size == 1:
        own = dataclasses.replace(identity, run=f"{identity.run}-{os.getpid()}")
        log.warning("rankscope: %s; this process (pid %d) reports as run %r instead. Set RANKSCOPE_RUN to name "
                    "your runs.", described, os.getpid(), own.run)
        return own
    raise ConfigError(f"{described}; this job (launched by pid {launcher}) would add its counts to that run's. "
                      "Give each job its own run: RANKSCOPE_RUN, or torchrun --rdzv-id", field="run")


def prepare_run_dir(run_dir: Path, identity: RankIdentity) -> Registration:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"metrics_dir: cannot write to {run_dir}: {e.strerror or e}") from None
    pid, launcher = os.getpid(), launcher_pid()
    remove_previous_launch(run_dir, launcher, process_start_ticks(launcher))
    registration = Registration(
        run=identity.run, rank=identity.rank, local_rank=identity.local_rank, node=identity.node,
        world_size=identity.world_size, local_world_size=identity.local_world_size,
        pid=pid, pid_start_ticks=process_start_ticks(pid), agent_pid=launcher,
        agent_start_ticks=process_start_ticks(launcher), started_at=time.time(),
    )
    registration.save(run_dir)
    return registration


class StepsSeen(Protocol):
    """The completed steps handed over so far (``rankscope.step.handoff.StepHandoff``)."""

    steps_seen: int


class RankInfo:
    """Writes rank_info once the backend and device are known: the backend given, or the process
    group's, or none at all; the CUDA device given, or else the one the first step ran on
    (rankscope.device.rank_device: a ``Monitor()`` without a device learns it from its model or values)."""

    def __init__(self, identity: RankIdentity, device: RankDevice, backend: str | None, registration: Registration,
                 run_dir: Path, metrics: RankMetrics, steps: StepsSeen):
        self._identity = identity
        self._device = device
        self._backend = backend
        self._registration = registration
        self._run_dir = run_dir
        self._metrics = metrics
        self._steps = steps
        # On a GPU machine a Monitor() without a device may learn it at the first step: wait for it.
        self._device_may_come = not device.cuda and device.api.available()
        self._info: dict[str, str] | None = None   # described and saved, once the backend is known
        self.written = False                         # the rank_info series is written

    def publish_when_known(self, final: bool = False) -> None:
        """Without a process group by the first completed step (or at close), the rank is
        not distributed: backend ""."""
        self.save_when_known(final)
        self.publish_saved()

    # The publisher calls the two halves as two parts, each in its own GIL stretch:
    # the file write alone takes ~0.5 ms.
    def save_when_known(self, final: bool = False) -> None:
        """Describes the rank and saves it with its registration, once the backend is known."""
        if self._info is not None:
            return
        first_step_done = self._steps.steps_seen > 0
        backend = self._backend if self._backend is not None else _process_group_backend()
        if not final and not first_step_done and (backend is None or self._device_may_come and not self._device.cuda):
            return
        info = describe(self._identity, self._device, backend or "")
        self._registration.info = info
        self._registration.save(self._run_dir)
        self._info = info

    def publish_saved(self) -> None:
        """Writes the rank_info series, once, after ``save_when_known``."""
        if self._info is not None and not self.written:
            self._metrics.set_rank_info(self._info)
            self.written = True


def _process_group_backend() -> str | None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return str(dist.get_backend())
    return None


def gpu_uuid(uuid: str, name: str) -> str:
    """The UUID NVML gives the rank's GPU, so that ``rank_info{gpu_uuid}`` joins the exporter's
    ``rankscope_gpu_*{uuid}``. torch prints it without NVML's prefix. A MIG instance has its own
    UUID ("MIG-..."), but NVML reads clocks, power and errors of the physical GPU: its parent's
    UUID is the one that joins (found through NVML once; the instance's own if NVML cannot)."""
    if not uuid or uuid.startswith(("GPU-", "MIG-")):
        return uuid
    if "MIG" not in name.split():
        return f"GPU-{uuid}"
    return _mig_parent_uuid(f"MIG-{uuid}")


def _mig_parent_uuid(mig_uuid: str) -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(mig_uuid)
            parent = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
            uuid = pynvml.nvmlDeviceGetUUID(parent)
            return uuid.decode() if isinstance(uuid, bytes) else str(uuid)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return mig_uuid


def describe(identity: RankIdentity, device: Any, backend: str) -> dict[str, str]:
    """The labels of rank_info beyond identity."""
    import torch

    from rankscope import __version__

    name, uuid = "cpu", ""
    if device.cuda:   # read when the device was bound (rankscope.device.rank_device)
        name = f"cuda:{device.index}"
        uuid = gpu_uuid(device.uuid, device.name)
    nccl = ""
    try:
        if device.api.available():
            nccl = device.api.nccl_version()
    except Exception:   # a CUDA build without NCCL
        nccl = ""
    return {
        "world_size": str(identity.world_size), "local_world_size": str(identity.local_world_size),
        "process_id": str(os.getpid()), "hostname": os.uname().nodename, "device": name, "gpu_uuid": uuid,
        "backend": backend, "torch_version": torch.__version__, "nccl_version": nccl,
        "rankscope_version": __version__, "slurm_job_id": identity.slurm_job_id,
        "k8s_pod": identity.k8s_pod,
    }
