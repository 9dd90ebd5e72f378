"""Run a user's own training script (tests/loops/) the way a new user would.

    with UserJob("grad_accum.py", "inside", tmp_path=tmp_path) as job:          # python grad_accum.py inside
        job.run(timeout=60)
        samples = job.scrape()
    with UserJob("train.py", "--steps", "30", nproc=2, tmp_path=tmp_path) as job:  # torchrun, 2 ranks
        ...

The script runs against the installed package (no repository on PYTHONPATH,
nothing from this shell's RANKSCOPE_* or torchrun variables), with its own
metrics directory and a free metrics port under ``tmp_path``. It writes
what it measured itself (wall time, the values it reported) as
``<out>/rank<N>.json`` (``LOOP_OUT``); ``results()`` reads them.

On exit, whatever the test's outcome: the launcher's process group (torchrun
and its ranks, or the single python process) is killed, then any rank still
registered, then the exporter the job auto-started (its pid from /healthz).
On failure the job's log is printed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterable

from prometheus_client.samples import Sample

from tests.helpers.jobs import REPO, free_port, scrape, select

LOOPS = REPO / "tests" / "loops"

# Variables a launcher or an earlier in-process Monitor may have left in this
# shell; a user's fresh job has none of them.
_SCRUB = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
          "MASTER_PORT", "TORCHELASTIC_RUN_ID", "PROMETHEUS_MULTIPROC_DIR", "PYTHONPATH", "SLURM_PROCID",
          "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_ID", "SLURM_NTASKS_PER_NODE", "SLURMD_NODENAME")


class UserJob:
    def __init__(self, script: str | Path, *args: str, tmp_path: Path, nproc: int | None = None,
                 env: dict[str, str] | None = None, cwd: Path | None = None, run_id: str | None = None,
                 port: int | None = None, metrics_dir: Path | None = None, name: str = "job"):
        self.script = Path(script) if Path(script).is_absolute() else LOOPS / script
        self.args = [str(a) for a in args]
        self.nproc = nproc
        self.port = port or free_port()
        self.run_id = run_id or f"loop-{self.port}"
        self.metrics_dir = Path(metrics_dir or tmp_path / "metrics")
        self.out = tmp_path / f"{name}-out"
        self.cwd = Path(cwd or tmp_path)
        self.log_path = tmp_path / f"{name}.log"
        self.extra_env = dict(env or {})
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        self.proc: subprocess.Popen | None = None
        self.exporter_pid: int | None = None
        self._log = None

    # -- launching --------------------------------------------------------------
    @property
    def command(self) -> list[str]:
        if self.nproc is None:
            return [sys.executable, str(self.script), *self.args]
        # torchrun's own entry point, as a user types it (``python -m`` would put the cwd on the agent's path)
        torchrun = Path(sys.executable).parent / "torchrun"
        launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
        return [*launcher, "--standalone", "--nproc-per-node", str(self.nproc), str(self.script), *self.args]

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _SCRUB and not k.startswith("RANKSCOPE_")}
        env.update({"RANKSCOPE_METRICS_DIR": str(self.metrics_dir), "RANKSCOPE_METRICS_PORT": str(self.port),
                    "RANKSCOPE_RUN": self.run_id, "LOOP_OUT": str(self.out), "PYTHONUNBUFFERED": "1",
                    "OMP_NUM_THREADS": "1"})
        env.update(self.extra_env)
        return env

    def start(self, command: list[str] | None = None) -> "UserJob":
        self.out.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(command or self.command, cwd=self.cwd, env=self.environment(), stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def wait(self, timeout: float = 90.0, check: bool = True) -> int:
        assert self.proc is not None
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.script.name} did not finish within {timeout:.0f} s; log:\n"
                                 f"{self.log()[-3000:]}") from None
        if check and rc != 0:
            raise AssertionError(f"{self.script.name} exited {rc}; log:\n{self.log()[-3000:]}")
        return rc

    def run(self, timeout: float = 90.0, check: bool = True) -> int:
        return self.start().wait(timeout, check)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    # -- what it reported ---------------------------------------------------------
    def results(self) -> dict[int, dict]:
        """rank -> what the script wrote about itself."""
        out = {}
        for path in sorted(self.out.glob("rank*.json")):
            out[int(path.stem[4:])] = json.loads(path.read_text())
        return out

    def scrape(self) -> list[Sample]:
        samples = scrape(self.url)
        if self.exporter_pid is None:
            self.exporter_pid = self._health_pid()
        return samples

    def series(self, samples: Iterable[Sample], name: str, **labels: str) -> list[Sample]:
        return select(samples, name, run=self.run_id, **labels)

    def state(self, samples: Iterable[Sample], rank: int = 0) -> str | None:
        """The exporter's rankscope_rank_state for a rank: the state whose value is 1."""
        on = [s.labels["state"] for s in select(samples, "rankscope_rank_state", run=self.run_id, rank=str(rank))
              if s.value == 1]
        return on[0] if len(on) == 1 else None

    # -- clean-up ------------------------------------------------------------------
    def __enter__(self) -> "UserJob":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.kill()
        finally:
            if self._log is not None:
                self._log.close()
            if exc_type is not None:
                print(f"--- {self.script.name} log ({self.log_path}) ---\n{self.log()[-4000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for pid in self._rank_pids():
            _kill(pid)
        pid = self.exporter_pid or self._health_pid()
        if pid:
            _kill(pid)

    def _rank_pids(self) -> list[int]:
        from rankscope.contract.rundir import load_registrations

        pids = []
        for ranks in self.metrics_dir.glob("*/ranks"):
            # only a process that is still the one registered (a finished rank's pid may be reused)
            pids += [reg.pid for reg in load_registrations(ranks.parent) if reg.process_alive()]
        return [p for p in pids if p != os.getpid()]

    def _health_pid(self) -> int | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2) as resp:
                return int(json.loads(resp.read())["pid"])
        except Exception:
            return None


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def wait_for_file(path: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return True
        time.sleep(0.05)
    return False
