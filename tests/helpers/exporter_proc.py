"""A real exporter process (``python -m rankscope.exporter``) and synthetic rank processes, for tests.

    with ExporterProcess(metrics_dir) as exp:        # free port, waits for /healthz
        scrape(exp.url)
    with SyntheticRanks(metrics_dir, n=8) as ranks:   # 8 processes writing real rank files
        ...

Synthetic ranks are real processes that create ``rankscope.publishing.metrics.RankMetrics``
and a ``rankscope.contract.rundir.Registration`` exactly as a Monitor does, and
then step: no torch, so eight of them start in a second on two cores.
Everything started here is killed by pid on exit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil

from tests.helpers.jobs import REPO, free_port

SYNTHETIC_RANK = r"""
import os, sys, time
from pathlib import Path
from rankscope.contract.catalog import RANK_INFO_LABELS
from rankscope.publishing.metrics import RankMetrics
from rankscope.contract.rundir import Registration, process_start_ticks, run_slug

metrics_dir, run, rank, world = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
run_dir = metrics_dir / run_slug(run)
run_dir.mkdir(parents=True, exist_ok=True)
labels = {"run": run, "rank": str(rank), "local_rank": str(rank), "node": "synthetic"}
pid, agent = os.getpid(), os.getppid()
reg = Registration(run=run, rank=rank, local_rank=rank, node="synthetic", world_size=world,
                   local_world_size=world, pid=pid, pid_start_ticks=process_start_ticks(pid), agent_pid=agent,
                   agent_start_ticks=process_start_ticks(agent), started_at=time.time())
reg.save(run_dir)
m = RankMetrics(run_dir, labels)
info = dict.fromkeys(RANK_INFO_LABELS, "")
info.update({"process_id": str(pid), "world_size": str(world), "local_world_size": str(world)})
m.set_rank_info(info)
print("ready", flush=True)
step = 0
while True:
    now = time.time()
    m.heartbeat.set(now)
    m.steps.inc()
    m.step.set(step)
    m.step_duration.observe(0.05)
    m.step_ts.set(now)
    m.observed["loss"].set(1.0 / (step + 1))
    m.collective("all_reduce").duration.observe(0.01)
    step += 1
    time.sleep(0.1)
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def kill(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)


class ExporterProcess:
    """``python -m rankscope.exporter --port P --dir D [args]``, waited for until it answers."""

    def __init__(self, metrics_dir: Path, args: list[str] = (), port: int | None = None,
                 env: dict[str, str] | None = None, scheme: str = "http", ready=None):
        self.metrics_dir = Path(metrics_dir)
        self._own_port = port is None   # a port we picked may be picked again by another test: then pick anew
        self.port = port or free_port()
        self.args = list(args)
        self.env = {**_env(), **(env or {})}
        self.scheme = scheme
        self.ready = ready
        self.proc: subprocess.Popen | None = None
        self.log_path = self.metrics_dir.parent / f"{self.metrics_dir.name}.exporter-{self.port}.log"

    @property
    def base(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.base}/metrics"

    def start(self) -> "ExporterProcess":
        for attempt in range(3):
            self._launch()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                try:
                    if self._answers():
                        return self
                except OSError:   # not up yet
                    pass
                time.sleep(0.1)
            else:
                raise TimeoutError(f"exporter on port {self.port} did not answer in 30 s: {self.log()[-3000:]}")
            # A port we picked may have been picked by another exporter meanwhile (free_port's port is
            # only free a moment): pick anew.
            if not (self._own_port and attempt < 2 and "already in use" in self.log()):
                raise AssertionError(f"exporter exited with {self.proc.returncode}: {self.log()[-3000:]}")
            self.stop()
            self.port = free_port()
        raise AssertionError("unreachable")

    def _launch(self) -> None:
        cmd = [sys.executable, "-m", "rankscope.exporter", "--port", str(self.port), "--dir", str(self.metrics_dir),
               "--no-nvml", *self.args]
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def _answers(self) -> bool:
        # Another exporter on the same port would answer too: only ours counts.
        if not any(c.laddr.port == self.port and c.status == psutil.CONN_LISTEN
                   for c in psutil.Process(self.proc.pid).net_connections(kind="tcp")):
            return False
        if self.ready is not None:
            return self.ready(self)
        with urllib.request.urlopen(f"{self.base}/healthz", timeout=2) as resp:
            return resp.status == 200

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        kill(self.proc)
        if getattr(self, "_log", None):
            self._log.close()
            self._log = None

    def __enter__(self) -> "ExporterProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        if exc[0] is not None:
            print(f"--- exporter log ---\n{self.log()[-3000:]}")
        self.log_path.unlink(missing_ok=True)


class SyntheticRanks:
    """``n`` processes of one run writing rank files into ``metrics_dir``."""

    def __init__(self, metrics_dir: Path, n: int, run: str = "synthetic"):
        self.metrics_dir, self.n, self.run = Path(metrics_dir), n, run
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "SyntheticRanks":
        for rank in range(self.n):
            self.procs.append(subprocess.Popen(
                [sys.executable, "-c", SYNTHETIC_RANK, str(self.metrics_dir), self.run, str(rank), str(self.n)],
                cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + 60
        for p in self.procs:
            line = p.stdout.readline()
            if line.strip() != b"ready" or time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise AssertionError(f"synthetic rank failed to start: {line!r}")
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            kill(p)
            if p.stdout:
                p.stdout.close()
