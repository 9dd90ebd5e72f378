"""Issue 17 (part 2): rank 0's TensorBoard and MLflow sink (rankscope.sinks, docs/sinks.md).

Real 2-rank torchrun jobs of the reference trainer (gloo, 127.0.0.1, the
exporter the Monitor starts) write one step-indexed run; it is read back with
TensorBoard's own event reader and with ``MlflowClient``. A real ``mlflow
server`` killed mid-run shows that training goes on (step rate before and
after, printed, never asserted) and that the lost records are counted.

The first tests are of the start-up checks and of the writers (no job); the summary's own are
in tests/unit/sinks/test_summary.py.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from rankscope import sinks
from rankscope.config import MonitorConfig
from rankscope.contract.environment import ConfigError
from rankscope.identity import RankIdentity
from rankscope.sinks import backend as sink_backend
from tests.helpers.jobs import TrainJob, free_port, select, value, wait_until

T = sinks.TAG
STEP_TAGS = [T + "step_time/min", T + "step_time/median", T + "step_time/max", T + "slowest_rank",
             T + "straggler_ratio", T + "comm_wait_fraction", T + "loss/spread", T + "loss/std"]
EVENT_TAGS = [T + "events/nonfinite", T + "events/oom", T + "events/restarts", T + "events/hang_suspects",
              T + "ranks/reporting"]
SLOW = ["--step-delay", "0.01", "--slow-rank-delay", "0.03", "--fault-rank", "1"]   # rank 1: +30 ms of compute


# -- start-up checks -------------------------------------------------------------------------
def _identity(rank: int = 0) -> RankIdentity:
    return RankIdentity(run="r", rank=rank, local_rank=rank, world_size=2, local_world_size=2, node="n")


class _Drops:
    def __init__(self):
        self.n = 0
        self.reasons: list[str] = []

    def drop(self, what: str, reason: str = "", n: int = 1) -> None:
        assert what == "sink"
        self.n += n
        self.reasons.append(reason)


def test_config_errors_name_the_option(tmp_path):
    for env, words in [({"RANKSCOPE_MLFLOW_TRACKING_URI": "ftp://host/x"}, "RANKSCOPE_MLFLOW_TRACKING_URI"),
                       ({"RANKSCOPE_SINK_EXPORTERS": "node1"}, "RANKSCOPE_SINK_EXPORTERS"),
                       ({"RANKSCOPE_SINK_INTERVAL_S": "0"}, "sink_interval_s"),
                       ({"RANKSCOPE_TENSORBOARD_DIR": str(Path(__file__))}, "is not a directory")]:
        with pytest.raises(ConfigError, match=words):
            MonitorConfig.from_env(env)
    cfg = MonitorConfig.from_env({"RANKSCOPE_SINK_EXPORTERS": "n1:9400, https://n2:9401/metrics"})
    assert sinks.exporter_urls(cfg.sink_exporters) == ["http://n1:9400/metrics", "https://n2:9401/metrics"]


def test_build_checks_packages_directories_and_rank(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    cfg = MonitorConfig.from_env({}, tensorboard_dir=ro / "tb", metrics_dir=tmp_path / "m")
    if os.geteuid() != 0:   # root writes anywhere
        with pytest.raises(ConfigError, match="cannot be written"):
            sinks.build(cfg, _identity(), _Drops())
    cfg = MonitorConfig.from_env({}, tensorboard_dir=tmp_path / "tb", metrics_dir=tmp_path / "m")
    assert sinks.build(cfg, _identity(rank=1), _Drops()) is None          # only rank 0 writes
    sink = sinks.build(cfg, _identity(), _Drops())
    assert sink.urls == ["http://127.0.0.1:9400/metrics"] and [b.name for b in sink.backends] == ["tensorboard"]
    with pytest.raises(ConfigError, match="exporter=off"):
        sinks.build(MonitorConfig.from_env({}, tensorboard_dir=tmp_path / "tb", exporter="off",
                                           metrics_dir=tmp_path / "m"), _identity(), _Drops())
    with pytest.raises(ConfigError, match="does not exist"):
        sinks.build(MonitorConfig.from_env({}, mlflow_tracking_uri=f"sqlite:///{tmp_path}/nowhere/m.db",
                                           metrics_dir=tmp_path / "m"), _identity(), _Drops())
    monkeypatch.setattr(sink_backend, "missing", lambda module: True)
    with pytest.raises(ConfigError, match=r"pip install 'rankscope\[tensorboard\]'"):
        sinks.build(cfg, _identity(), _Drops())
    with pytest.raises(ConfigError, match=r"pip install 'rankscope\[mlflow\]'"):
        sinks.build(MonitorConfig.from_env({}, mlflow_tracking_uri="http://127.0.0.1:1",
                                           metrics_dir=tmp_path / "m"), _identity(), _Drops())


class _Stuck(sinks.Backend):
    """A backend whose writes never return (a hung file system): the queue fills, records are dropped."""

    name = "stuck"

    def __init__(self):
        import threading

        self.release = threading.Event()

    def open(self) -> None:
        pass

    def write(self, record: sinks.Record) -> None:
        self.release.wait()


@pytest.mark.parametrize("interval_s, records", [(1.0, 120), (10.0, 12), (60.0, 8)])
def test_a_backend_may_fall_two_minutes_behind_before_records_drop(interval_s, records):
    # At a 1 s interval, 8 records were fewer than MLflow's import and schema creation take on a busy node.
    sink = sinks.Sink(["http://127.0.0.1:1/metrics"], "r", interval_s, [_Stuck()], _Drops().drop)
    assert [w.queue.maxsize for w in sink.writers] == [records]


def test_a_stuck_backend_drops_and_counts_and_never_blocks_the_caller():
    drops = _Drops()
    backend = _Stuck()
    writer = sinks.Writer(backend, drops.drop)
    writer.thread.start()
    rec = sinks.Record(1, {T + "x": 1.0}, [], time.time())
    t0 = time.perf_counter()
    for _ in range(sinks.QUEUE_MIN_RECORDS + 10):
        writer.offer(rec)
    offered_s = time.perf_counter() - t0
    assert drops.n >= 10, drops.n      # one in the backend's hands, QUEUE_MIN_RECORDS waiting, the rest dropped
    print(f"{sinks.QUEUE_MIN_RECORDS + 10} offers to a stuck backend took {offered_s * 1e6:.0f} us; {drops.n} dropped")
    backend.release.set()
    writer.closing.set()
    writer.thread.join(5)
    assert not writer.thread.is_alive()


def test_mlflow_backend_to_a_dead_server_counts_drops(tmp_path):
    """In-process: the MLflow writer against a port nobody listens on. Every record is counted as
    dropped, quickly (the sink's short HTTP settings, not MLflow's minutes of retries)."""
    pytest.importorskip("mlflow")
    drops = _Drops()
    env_before = {k: os.environ.get(k) for k in sinks.MLFLOW_HTTP_DEFAULTS}
    writer = sinks.Writer(sinks.MlflowBackend(f"http://127.0.0.1:{free_port()}", "rankscope", "dead"), drops.drop)
    writer.thread.start()
    try:
        rec = sinks.Record(1, {T + "x": 1.0}, ["step 1: something"], time.time())
        for _ in range(3):
            writer.offer(rec)
        wait_until(lambda: drops.n >= 3, timeout=60, what="three records counted as dropped")
    finally:
        writer.closing.set()
        writer.thread.join(30)
        for k, v in env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert not writer.thread.is_alive()
    assert any("mlflow" in r for r in drops.reasons)


def test_the_sink_runs_in_a_process_of_its_own_whose_drops_rank_0_counts():
    """The sink's scrapes, summaries and writes run in a child process (they once took rank 0's
    interpreter from its training thread): rank 0 holds only the thread that counts what the
    child reports, here the records lost because no exporter answers."""
    drops = _Drops()
    sink = sinks.SinkProcess([f"http://127.0.0.1:{free_port()}/metrics"], "r", 0.2, [], drops.drop)
    sink.start()
    try:
        assert sink.child is not None and sink.child.poll() is None
        ours = sorted(t.name for t in threading.enumerate() if t.name.startswith("rankscope-sink"))
        assert ours == ["rankscope-sink-reports"], ours
        wait_until(lambda: drops.n >= 2, timeout=30, what="drops reported by the sink's process")
    finally:
        t0 = time.monotonic()
        sink.stop(timeout_s=3.0)
        took = time.monotonic() - t0
    assert sink.child.returncode == 0 and took < 3.0 + sinks.process.STOP_MARGIN_S, (sink.child.returncode, took)
    assert drops.reasons and all("no exporter answered" in r for r in drops.reasons), drops.reasons


def test_a_sink_process_that_fails_is_counted_at_once(monkeypatch):
    """A child that cannot run (here: no Python at all) loses every record: counted when it ends,
    not only at close, and training's start is not stopped by it."""
    drops = _Drops()
    monkeypatch.setattr(sys, "executable", "/bin/false")
    sink = sinks.SinkProcess([f"http://127.0.0.1:{free_port()}/metrics"], "r", 0.2, [], drops.drop)
    sink.start()
    wait_until(lambda: drops.n >= 1, timeout=10, what="the failed sink process counted")
    assert any("ended with 1" in r or "did not start" in r for r in drops.reasons), drops.reasons
    sink.stop(timeout_s=1.0)


def test_the_sink_process_ends_when_rank_0_goes_away():
    """Rank 0 killed: the end of the pipe it held tells the child to write its last record and end."""
    sink = sinks.SinkProcess([f"http://127.0.0.1:{free_port()}/metrics"], "r", 0.2, [], _Drops().drop)
    sink.start()
    sink.child.stdin.close()   # what rank 0's death does to the pipe
    assert sink.child.wait(sinks.process.LIFELINE_CLOSED_STOP_S + 5) == 0


FULL_DISK = r"""
import resource, signal, sys, time
from pathlib import Path
from rankscope import sinks
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)     # a write past the limit fails with EFBIG instead
drops = []
w = sinks.Writer(sinks.TensorBoardBackend(Path(sys.argv[1]), "full"), lambda what, reason="", n=1: drops.append(n))
w.thread.start()

def offer(first, n):
    worst = 0.0
    for i in range(first, first + n):
        rec = sinks.Record(i, {f"rankscope/t{j}": float(i) for j in range(20)}, [], time.time())
        t0 = time.perf_counter()
        w.offer(rec)
        worst = max(worst, time.perf_counter() - t0)
        time.sleep(0.005)
    return worst

offer(0, 5)
while w.queue.qsize() or not list(Path(sys.argv[1]).glob("full/events.out.tfevents.*")):
    time.sleep(0.05)
time.sleep(0.5)
before = sum(drops)
resource.setrlimit(resource.RLIMIT_FSIZE, (1, resource.RLIM_INFINITY))   # the disk is full: no file grows
worst = offer(5, 100)
time.sleep(1.0)
full = sum(drops) - before
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))   # space again
offer(105, 10)
w.closing.set()
w.thread.join(10)
print("RESULT", before, full, sum(drops) - before - full, int(w.thread.is_alive()), round(worst * 1e6))
"""


def test_a_full_disk_drops_tensorboard_records_and_the_sink_recovers(tmp_path):
    """A subprocess whose file-size limit stands in for a full disk: TensorBoard's writer fails
    (its own writer thread dies, and prints its traceback once per event file), each record is
    counted as dropped, offering never blocks, and once there is space again a new event file
    in the same run takes the records."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path)], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[2])
    result = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    assert result, out.stdout + out.stderr[-3000:]
    before, full, after, alive, worst_us = map(int, result[0].split()[1:])
    print(f"drops: {before} before, {full} of 100 records while full, {after} after; worst offer {worst_us} us")
    assert before == 0 and after == 0 and alive == 0
    assert full >= 99, full        # every record while full (one may be in the writer's hands at the switch)
    acc = EventAccumulator(str(tmp_path / "full"), size_guidance={"scalars": 0})
    acc.Reload()
    steps = [e.step for e in acc.Scalars(T + "t0")]
    assert set(range(105, 115)) <= set(steps), steps


# -- real jobs -------------------------------------------------------------------------------
def _tb_scalars(log_dir: Path) -> dict[str, list]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]}


def _check_series(series: dict[str, list[tuple[int, float]]]) -> None:
    """The tags are there, steps increase, rank 1 (slowed) is named the slowest in every record."""
    for tag in STEP_TAGS + EVENT_TAGS:
        assert tag in series, f"no {tag}: {sorted(series)}"
    for tag, points in series.items():
        steps = [s for s, _ in points]
        assert steps == sorted(steps), (tag, steps)
        if tag in STEP_TAGS:
            assert len(steps) == len(set(steps)), (tag, steps)   # a step-time record per step reached
    assert len(series[T + "step_time/median"]) >= 5, series[T + "step_time/median"]
    assert series[T + "step_time/median"][-1][0] >= 250          # the last record is near the last step (299)
    slowest = [int(v) for _, v in series[T + "slowest_rank"]]
    # Rank 1 in every record after the first, whose steps ran before DDP's first sampled timers
    # told rank 0's wait from its compute. When the sink was a thread of rank 0's process, MLflow's
    # import and schema slowed rank 0's own steps, and the first four records named it, rightly.
    assert all(rank == 1 for rank in slowest[1:]), slowest
    ratios = [v for _, v in series[T + "straggler_ratio"]]
    assert statistics.median(ratios) > 1.5, ratios
    for tag in (T + "events/nonfinite", T + "events/oom", T + "events/restarts", T + "events/hang_suspects"):
        assert all(v == 0 for _, v in series[tag]), (tag, series[tag])
    assert all(v == 2 for _, v in series[T + "ranks/reporting"])
    assert all(0 <= v <= 1 for _, v in series[T + "comm_wait_fraction"])
    assert T + "mfu" not in series          # a CPU job publishes no device peak: MFU is never invented
    for _, v in series.get(T + "goodput", []):
        assert 0 <= v <= 1


def _sink_drops(job: TrainJob) -> float:
    return value(job.scrape(), "rankscope_telemetry_dropped_total", rank="0", what="sink") or 0.0


def test_tensorboard_sink_in_a_real_job(tmp_path):
    tb = tmp_path / "tb"
    with TrainJob(nproc=2, steps=300, extra_args=SLOW,
                  env={"RANKSCOPE_TENSORBOARD_DIR": str(tb), "RANKSCOPE_SINK_INTERVAL_S": "1"}) as job:
        assert job.wait(timeout=180) == 0, job.log()[-3000:]
        assert _sink_drops(job) == 0
        run_dirs = list(tb.iterdir())
        assert [d.name for d in run_dirs] == [job.run_id], run_dirs    # one run, from rank 0 only
        assert len(list(run_dirs[0].glob("events.out.tfevents.*"))) == 1
        scalars = _tb_scalars(run_dirs[0])
    _check_series({tag: [(e.step, e.value) for e in events] for tag, events in scalars.items()})
    print("tensorboard tags:", sorted(scalars))
    print("slowest_rank / straggler_ratio:",
          [(e.step, round(r.value, 2)) for e, r in zip(scalars[T + "slowest_rank"], scalars[T + "straggler_ratio"])])


def test_mlflow_sink_in_a_real_job(tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    with TrainJob(nproc=2, steps=300, extra_args=SLOW,
                  env={"RANKSCOPE_MLFLOW_TRACKING_URI": uri, "RANKSCOPE_SINK_INTERVAL_S": "1",
                       "RANKSCOPE_MLFLOW_EXPERIMENT": "sink-test"}) as job:
        assert job.wait(timeout=180) == 0, job.log()[-3000:]
        assert _sink_drops(job) == 0
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("sink-test")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, runs                       # one run per job, not per rank
    run = runs[0]
    assert run.info.status == "FINISHED" and run.data.tags[sinks.MLFLOW_RUN_TAG] == job.run_id
    series = {key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
              for key in run.data.metrics}
    _check_series(series)
    print("mlflow metrics:", sorted(series))


# -- a real MLflow server, killed mid-run ----------------------------------------------------
class MlflowServer:
    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log_path = root / "mlflow-server.log"
        self.db = root / "mlflow.db"

    def __enter__(self) -> "MlflowServer":
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{self.db}",
             "--default-artifact-root", str(self.root / "artifacts"), "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1"],
            cwd=self.root, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(self._healthy, timeout=90, interval=0.25, what="mlflow server /health")
        return self

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"mlflow server exited: {self.log_path.read_text()[-2000:]}")
        with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
            return resp.status == 200

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)   # its own session: the server and its workers
            self.proc.wait(timeout=10)

    def __exit__(self, *exc) -> None:
        self.kill()
        self._log.close()


def _window(job: TrainJob, seconds: float) -> dict[str, dict[str, float]]:
    """Per rank, over ``seconds``: steps per second and mean step seconds (from the ranks' counters)."""
    a = job.scrape()
    t0 = time.monotonic()
    time.sleep(seconds)
    b = job.scrape()
    span = time.monotonic() - t0
    out = {}
    for r in ("0", "1"):
        d = {n: value(b, n, rank=r) - value(a, n, rank=r)
             for n in ("rankscope_steps_total", "rankscope_step_duration_seconds_sum",
                       "rankscope_step_duration_seconds_count")}
        out[r] = {"steps_per_s": d["rankscope_steps_total"] / span,
                  "step_ms": 1000 * d["rankscope_step_duration_seconds_sum"] / max(d["rankscope_step_duration_seconds_count"], 1)}
    return out


def test_killed_mlflow_server_does_not_disturb_training(tmp_path):
    from mlflow import MlflowClient

    window_s = 6.0
    with MlflowServer(tmp_path) as server:
        with TrainJob(nproc=2, steps=1500, extra_args=["--step-delay", "0.02"],
                      env={"RANKSCOPE_MLFLOW_TRACKING_URI": server.url, "RANKSCOPE_SINK_INTERVAL_S": "1",
                           "RANKSCOPE_MLFLOW_EXPERIMENT": "killed"}) as job:
            client = MlflowClient(f"sqlite:///{server.db}")   # the server's own store, readable after its death

            def logged() -> int:
                exp = client.get_experiment_by_name("killed")
                runs = client.search_runs([exp.experiment_id]) if exp else []
                return runs and len(client.get_metric_history(runs[0].info.run_id, T + "step_time/median"))

            wait_until(lambda: logged() >= 3, timeout=90, what="three records through the live server")
            job.wait_for(lambda s: all((value(s, "rankscope_steps_total", rank=r) or 0) >= 100 for r in ("0", "1")),
                         timeout=60, what="100 steps")
            before = _window(job, window_s)
            assert _sink_drops(job) == 0
            through_server = logged()
            server.kill()
            killed_at = time.monotonic()
            after = _window(job, window_s)
            wait_until(lambda: _sink_drops(job) > 0, timeout=60, what="records counted as dropped after the kill")
            assert job.proc.poll() is None, "the job should outlive both windows (raise --steps)"
            assert job.wait(timeout=180) == 0, job.log()[-3000:]
            exited = time.time()
            exit_after_kill = time.monotonic() - killed_at
            final = job.scrape()
            # From rank 0's last step to torchrun's exit: the last evaluation, the barrier, close() (the
            # sink's last record and its failed writes included), process-group teardown.
            tail_s = exited - value(final, "rankscope_last_step_timestamp_seconds", rank="0")
            drops = value(final, "rankscope_telemetry_dropped_total", rank="0", what="sink")
            assert select(final, "rankscope_rank_state", rank="0", state="finished")[0].value == 1
            assert value(final, "rankscope_steps_total", rank="0") == 1500
    assert drops > 0
    for r in ("0", "1"):
        print(f"rank {r}: before the kill {before[r]['steps_per_s']:.2f} steps/s, {before[r]['step_ms']:.1f} ms/step; "
              f"after {after[r]['steps_per_s']:.2f} steps/s, {after[r]['step_ms']:.1f} ms/step "
              f"({100 * (after[r]['step_ms'] / before[r]['step_ms'] - 1):+.1f}%)")
    print(f"records through the live server: {through_server}; sink drops counted on rank 0: {drops:.0f}; "
          f"job finished {exit_after_kill:.1f} s after the kill (rc 0), {tail_s:.2f} s after rank 0's last step")


# -- two nodes, one hung rank: the other node's exporter through RANKSCOPE_SINK_EXPORTERS --------
def test_two_nodes_and_a_hang_through_sink_exporters(tmp_path):
    """Two torchrun agents as two nodes (two ranks each, each node its exporter). Rank 0's sink
    reads node-b's exporter through RANKSCOPE_SINK_EXPORTERS, so it sees all four ranks, and records
    the hang of rank 3 (before the all-reduce of step 30) once: at step 29, as a count and as text."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    run_id = f"sink-nodes-{free_port()}"
    rdzv = free_port()
    states = {"RANKSCOPE_STUCK_AFTER_S": "5", "RANKSCOPE_FROZEN_AFTER_S": "4", "RANKSCOPE_SUSPECT_AFTER_S": "5",
              "OMP_NUM_THREADS": "1"}
    node_b = TrainJob(nproc=2, steps=100_000, run_id=run_id, nodes=(2, 1, rdzv),
                      extra_args=["--hang-at", "30", "--step-delay", "0.01"],
                      env={**states, "RANKSCOPE_NODE": "node-b"})
    node_a = TrainJob(nproc=2, steps=100_000, run_id=run_id, nodes=(2, 0, rdzv),
                      extra_args=["--hang-at", "30", "--step-delay", "0.01"],
                      env={**states, "RANKSCOPE_NODE": "node-a", "RANKSCOPE_TENSORBOARD_DIR": str(tb),
                           "RANKSCOPE_SINK_INTERVAL_S": "1", "RANKSCOPE_SINK_EXPORTERS": f"127.0.0.1:{node_b.port}"})

    def hang_recorded():
        acc = EventAccumulator(str(tb / run_id), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        tags = acc.Tags()
        if T + "events/hang_suspects" not in tags["scalars"]:
            return None
        if not any(e.value >= 1 for e in acc.Scalars(T + "events/hang_suspects")):
            return None
        return acc

    with node_a, node_b:
        acc = wait_until(hang_recorded, timeout=180, interval=1, what="the hang suspect in the TensorBoard run")
        time.sleep(4)   # four more intervals of the hang: nothing new, so no new record
        acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert max(v for _, v in scalars[T + "ranks/reporting"]) == 4, scalars[T + "ranks/reporting"]
    suspects = [(s, v) for s, v in scalars[T + "events/hang_suspects"] if v >= 1]
    assert suspects[0] == (29, 1.0), scalars[T + "events/hang_suspects"]
    assert len(suspects) == 1, suspects                # written once, not every interval of the hang
    texts = [t.tensor_proto.string_val[0].decode() for tag in acc.Tags()["tensors"] if tag.startswith(sinks.EVENTS_TEXT_TAG)
             for t in acc.Tensors(tag)]
    assert any("step 29: rank 3 is the hang suspect" in t for t in texts), texts
    print("event text:", texts)
    print("hang_suspects:", scalars[T + "events/hang_suspects"][-4:], "stalled:", scalars[T + "ranks/stalled"][-4:])
