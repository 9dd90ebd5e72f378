"""Real torchrun jobs of the reference trainer, for tests.

    with TrainJob(nproc=2, steps=300, extra_args=["--hang-at", "50"]) as job:
        job.wait_for(lambda samples: ..., timeout=60)

Each job gets its own metrics directory and a free port; on exit torchrun's
process group and the auto-started exporter are killed and the directory is
removed. Nothing is left running.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Callable, Iterable

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

REPO = Path(__file__).resolve().parents[2]


def rankscope_command() -> list[str]:
    """The installed console script, as a user runs it (the module when the script is not installed)."""
    script = Path(sys.executable).with_name("rankscope")
    return [str(script)] if script.exists() else [sys.executable, "-m", "rankscope.console"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape_text(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def parse(text: str) -> list[Sample]:
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def scrape(url: str, timeout: float = 5.0) -> list[Sample]:
    return parse(scrape_text(url, timeout))


def select(samples: Iterable[Sample], name: str, **labels: str) -> list[Sample]:
    """Samples of one series name whose labels include ``labels``."""
    return [s for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]


def value(samples: Iterable[Sample], name: str, **labels: str) -> float | None:
    found = select(samples, name, **labels)
    return found[0].value if len(found) == 1 else None


def wait_until(condition: Callable[[], object], timeout: float, interval: float = 0.25, what: str = "condition"):
    """Poll ``condition`` until it returns something truthy; fail with ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = condition()
            if result:
                return result
        except Exception as e:  # the server may not be up yet
            last_error = e
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}" +
                       (f" (last error: {last_error!r})" if last_error else ""))


class TrainJob:
    def __init__(self, nproc: int = 2, steps: int = 300, extra_args: Iterable[str] = (),
                 env: dict[str, str] | None = None, port: int | None = None, metrics_dir: Path | None = None,
                 run_id: str | None = None, nodes: tuple[int, int, int] | None = None,
                 wrap: list[str] | None = None, host: str = "127.0.0.1", master_addr: str = "127.0.0.1",
                 one_by_one: tuple[int, int, int] | None = None):
        """``nodes``: (node count, this node's rank, rendezvous port) to act as one node of a
        multi-node job (static rendezvous at ``master_addr``, where node 0 hosts the store).
        ``one_by_one``: (world size, this node's rank, store port): no torchrun; this node's
        ``nproc`` ranks are started one by one, each with its launcher's environment, as srun,
        mpirun or a pod per rank do (torchrun's agents wait for each other's nodes first, and
        start no rank while one is missing).
        ``wrap``: a command prefix that execs the rest (e.g. one that joins a cgroup or a network
        namespace first). ``host``: where this process reaches the job's exporter."""
        self.host = host
        self.master_addr = master_addr
        self.nodes = nodes
        self.one_by_one = one_by_one
        self.others: list[subprocess.Popen] = []   # one_by_one: the ranks after the first
        self.wrap = list(wrap or [])
        self.nproc = nproc
        self.steps = steps
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        self.port = port or free_port()
        self._own_dir = metrics_dir is None
        self.metrics_dir = Path(metrics_dir or tempfile.mkdtemp(prefix="rankscope-test-"))
        self.run_id = run_id or f"test-{self.port}"
        self.url = f"http://{host}:{self.port}/metrics"
        self.proc: subprocess.Popen | None = None
        self.exporter_pid: int | None = None
        self.log_path = self.metrics_dir.parent / f"{self.metrics_dir.name}.torchrun.log"
        self.started = 0.0

    @property
    def command(self) -> list[str]:
        if self.nodes is None:
            launch = ["--standalone"]
        else:
            count, node_rank, rdzv_port = self.nodes
            launch = ["--nnodes", str(count), "--node-rank", str(node_rank), "--master-addr", self.master_addr,
                      "--master-port", str(rdzv_port), "--rdzv-id", self.run_id]
        return [*self.wrap, sys.executable, "-m", "torch.distributed.run", *launch, "--nproc-per-node", str(self.nproc),
                *self.train_args]

    @property
    def train_args(self) -> list[str]:
        return ["-m", "rankscope.train", "--steps", str(self.steps), "--metrics-port", str(self.port),
                "--run-id", self.run_id, *self.extra_args]

    def __enter__(self) -> "TrainJob":
        env = {**os.environ, "RANKSCOPE_METRICS_DIR": str(self.metrics_dir), "PYTHONUNBUFFERED": "1",
               **self.extra_env}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        self._log = open(self.log_path, "wb")
        self.started = time.monotonic()
        if self.one_by_one is not None:
            world, node_rank, store_port = self.one_by_one
            command = [*self.wrap, sys.executable, *self.train_args]
            procs = [subprocess.Popen(command, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True,
                                      env={**env, "RANK": str(node_rank * self.nproc + local), "LOCAL_RANK": str(local),
                                           "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(self.nproc),
                                           "GROUP_RANK": str(node_rank), "MASTER_ADDR": self.master_addr,
                                           "MASTER_PORT": str(store_port)})
                     for local in range(self.nproc)]
            self.proc, self.others = procs[0], procs[1:]
            return self
        self.proc = subprocess.Popen(self.command, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        self._kill_exporter()
        self._log.close()
        if self._own_dir:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
        if exc[0] is None:
            self.log_path.unlink(missing_ok=True)
        else:
            print(f"--- torchrun log ({self.log_path}) ---\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        """Kill torchrun and its ranks (not the exporter, which lives in its own session)."""
        for proc in [self.proc, *self.others]:
            if proc and proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
        self._reap_ranks()

    def _reap_ranks(self) -> None:
        for pid in self.rank_pids().values():
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def _kill_exporter(self) -> None:
        pid = self.exporter_pid or self._health_pid()
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _health_pid(self) -> int | None:
        try:
            with urllib.request.urlopen(f"http://{self.host}:{self.port}/healthz", timeout=2) as resp:
                return int(json.loads(resp.read())["pid"])
        except Exception:
            return None

    def health(self) -> dict:
        with urllib.request.urlopen(f"http://{self.host}:{self.port}/healthz", timeout=2) as resp:
            doc = json.loads(resp.read())
        self.exporter_pid = int(doc["pid"])
        return doc

    def scrape(self) -> list[Sample]:
        samples = scrape(self.url)
        if self.exporter_pid is None:
            self.exporter_pid = self._health_pid()
        return samples

    def wait_for(self, predicate: Callable[[list[Sample]], object], timeout: float = 60.0,
                 what: str = "metrics condition"):
        try:
            return wait_until(lambda: predicate(self.scrape()), timeout, what=what)
        except TimeoutError:
            print(f"--- torchrun log ---\n{self.log()[-3000:]}")
            raise

    def wait(self, timeout: float = 120.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def rank_pids(self) -> dict[int, int]:
        """rank -> pid of its newest process, from the registrations."""
        from rankscope.contract.rundir import latest_per_rank, load_registrations

        out: dict[int, int] = {}
        for run_dir in self.metrics_dir.glob("*/ranks"):
            out.update({r: reg.pid for r, reg in latest_per_rank(load_registrations(run_dir.parent)).items()})
        return out
