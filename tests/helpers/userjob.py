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
``<out>/rank<N>.json`` (``LOOP_OUT``), or ``<out>/<scenario>/rank<N>.json``
for a script that runs several scenarios one after the other (each its own
run, ``<run id>-<scenario>``); ``results()`` reads them. A job may be
started more than once (a re-run: same run id, directory and exporter).

``JobPool`` runs whole jobs (a function that starts one, waits for it and
scrapes what it needs) on a few threads at once, so that a test module can
share each job among the tests that read it and overlap their start-up.

On exit, whatever the test's outcome: the launcher's process group (torchrun
and its ranks, or the single python process) is killed, then any rank still
registered, then the exporter the job auto-started (its pid from /healthz).
On failure the job's log is printed.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable

from prometheus_client.samples import Sample

from tests.helpers.jobs import REPO, free_port, scrape, select

LOOPS = REPO / "tests" / "loops"

# Variables a launcher or an earlier in-process Monitor may have left in this
# shell; a user's fresh job has none of them.
_SCRUB = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
          "MASTER_PORT", "TORCHELASTIC_RUN_ID", "PROMETHEUS_MULTIPROC_DIR", "PYTHONPATH", "SLURM_PROCID",
          "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_ID", "SLURM_NTASKS_PER_NODE", "SLURMD_NODENAME")


class UserJob:
    running: set["UserJob"] = set()   # started and not yet cleaned up (JobPool.close kills them)

    def __init__(self, script: str | Path, *args: str, tmp_path: Path, nproc: int | None = None,
                 env: dict[str, str] | None = None, cwd: Path | None = None, run_id: str | None = None,
                 port: int | None = None, metrics_dir: Path | None = None, name: str = "job",
                 python: Path | None = None):
        self.python = Path(python or sys.executable)   # another virtual environment's, for a framework of its own
        self.script = Path(script) if Path(script).is_absolute() else LOOPS / script
        self.args = [str(a) for a in args]
        self.nproc = nproc
        self.port = port or listen_port()
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
            return [str(self.python), str(self.script), *self.args]
        # torchrun's own entry point, as a user types it (``python -m`` would put the cwd on the agent's path)
        torchrun = self.python.parent / "torchrun"
        launcher = [str(torchrun)] if torchrun.exists() else [str(self.python), "-m", "torch.distributed.run"]
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
        if self._log is not None:   # started before: a re-run appends to the same log
            self._log.close()
        self._log = open(self.log_path, "ab")
        UserJob.running.add(self)
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

    def wait_for_file(self, path: Path, timeout: float) -> bool:
        """Whether ``path`` appeared within ``timeout`` s; False at once if the job has ended without it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists():
                return True
            if self.proc is not None and self.proc.poll() is not None:
                return path.exists()
            time.sleep(0.05)
        return False

    # -- what it reported ---------------------------------------------------------
    def results(self, scenario: str | None = None) -> dict[int, dict]:
        """rank -> what the script wrote about itself (about one scenario of a script that runs several)."""
        out = {}
        for path in sorted((self.out if scenario is None else self.out / scenario).glob("rank*.json")):
            out[int(path.stem[4:])] = json.loads(path.read_text())
        return out

    def scrape(self) -> list[Sample]:
        samples = scrape(self.url)
        if self.exporter_pid is None:
            self.exporter_pid = self._health_pid()
        return samples

    def series(self, samples: Iterable[Sample], name: str, run: str | None = None, **labels: str) -> list[Sample]:
        return select(samples, name, run=run or self.run_id, **labels)

    def state(self, samples: Iterable[Sample], rank: int = 0, run: str | None = None) -> str | None:
        """The exporter's rankscope_rank_state for a rank (of the job's run, or ``run``): the state whose value is 1."""
        on = [s.labels["state"] for s in select(samples, "rankscope_rank_state", run=run or self.run_id,
                                                rank=str(rank))
              if s.value == 1]
        return on[0] if len(on) == 1 else None

    # -- clean-up ------------------------------------------------------------------
    def __enter__(self) -> "UserJob":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.kill()
        finally:
            UserJob.running.discard(self)
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


_handed_out: set[int] = set()
_ports_lock = threading.Lock()


def listen_port() -> int:
    """A free port for a job's exporter, below the kernel's ephemeral range when there is room: the
    exporter binds it seconds after it is picked (once the script has imported torch), and until then
    a port from the ephemeral range may become the local end of another job's connection (gloo,
    torchrun's store, a scrape). Never the same port twice in this process."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    rng = random.Random()
    with _ports_lock:
        for _ in range(200 if low > 11000 else 0):
            port = rng.randrange(10000, low)
            if port in _handed_out:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
        port = free_port()
        _handed_out.add(port)
        return port


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class JobPool:
    """Whole jobs on at most ``parallel`` threads: ``submit(name, fn, *args)``, then ``get(name)``.

    ``fn`` starts a UserJob (``with UserJob(...) as job``), waits for it and
    returns what the tests need; the job is gone when ``fn`` returns. What
    ``fn`` raises comes back from ``get`` as ``JobError`` naming the job,
    with the traceback. A job submitted ``alone=True`` (one whose checks
    time the loop against its own clock) waits until no other job of the
    pool runs, and no other job starts until every such job has run: submit
    them first. On ``close()`` jobs not started yet are cancelled and every
    UserJob still running is killed."""

    def __init__(self, parallel: int):
        self._executor = ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="userjob")
        self._futures: dict[str, Future] = {}
        self._closing = threading.Event()
        self._turns = threading.Condition()
        self._running = 0          # jobs running now
        self._alone = 0            # alone jobs waiting or running: no other job starts meanwhile

    def submit(self, name: str, fn: Callable[..., Any], *args: Any, alone: bool = False) -> None:
        def run() -> Any:
            self._begin(alone)
            try:
                if self._closing.is_set():
                    raise JobError(f"job {name}: not started, the pool was closing")
                return fn(*args)
            except JobError:
                raise
            except Exception:
                raise JobError(f"job {name} failed:\n{traceback.format_exc()[-4000:]}") from None
            finally:
                self._end(alone)
        if alone:
            with self._turns:
                self._alone += 1
        self._futures[name] = self._executor.submit(run)

    def _begin(self, alone: bool) -> None:
        with self._turns:
            if alone:
                self._turns.wait_for(lambda: self._running == 0 or self._closing.is_set())
            else:
                self._turns.wait_for(lambda: self._alone == 0 or self._closing.is_set())
            self._running += 1

    def _end(self, alone: bool) -> None:
        with self._turns:
            self._running -= 1
            if alone:
                self._alone -= 1
            self._turns.notify_all()

    def get(self, name: str, timeout: float | None = None) -> Any:
        return self._futures[name].result(timeout)

    def close(self) -> None:
        self._closing.set()
        with self._turns:
            self._turns.notify_all()
        for future in self._futures.values():
            future.cancel()
        for job in list(UserJob.running):
            job.kill()
        self._executor.shutdown(wait=True)

    def __enter__(self) -> "JobPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class JobError(AssertionError):
    pass
