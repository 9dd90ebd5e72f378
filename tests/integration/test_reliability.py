"""Reliability drills (issue 9, drills 1-5 and 8), each with real processes.

Drills 1-3 share one real 2-rank torchrun job (start-up is the expensive
part on two cores) and run in file order: exporter SIGKILLed and restarted,
a rank SIGSTOPped and continued, a rank SIGKILLed; then a second job reuses
the directory and run id. Drill 2's "the others keep being served" half, and
drill 8 (load), use synthetic ranks: real processes writing real rank files
through ``rankscope.publishing.metrics.RankMetrics``. Drills 4 and 5 use one real
Monitor in a single-rank loop.

Every wait polls with a deadline; the only fixed windows are stated
observation periods (the dead rank's counters are watched for
DEAD_WATCH_S; the load runs for LOAD_SECONDS).
"""

from __future__ import annotations

import glob
import http.client
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.multiprocess import MultiProcessCollector

from tests.helpers.exporter_proc import ExporterProcess, SyntheticRanks, kill
from tests.helpers.jobs import REPO, TrainJob, free_port, scrape, select, value, wait_until

THRESHOLDS = {"RANKSCOPE_FROZEN_AFTER_S": "3", "RANKSCOPE_STUCK_AFTER_S": "30", "RANKSCOPE_SUSPECT_AFTER_S": "10"}
RUN = "drill-run"
DEAD_WATCH_S = 5.0
LOAD_SCRAPERS = 50
LOAD_SECONDS = 30.0
LOAD_RANKS = 8


def counters(samples, run: str) -> dict[tuple, float]:
    """Every monotonic series of a run: counters and histogram parts."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples
            if s.labels.get("run") == run and s.name.endswith(("_total", "_count", "_sum", "_bucket"))}


def state(samples, rank: str) -> str | None:
    on = [s.labels["state"] for s in select(samples, "rankscope_rank_state", rank=rank) if s.value == 1]
    return on[0] if len(on) == 1 else None


def steps(samples, rank: str, run: str = RUN) -> float:
    return value(samples, "rankscope_steps_total", rank=rank, run=run) or 0.0


def steps_in_files(run_dir: Path, rank: str) -> float:
    """steps_total read straight from the rank files (what any exporter would see)."""
    merged = MultiProcessCollector.merge(glob.glob(str(run_dir / "*.db")), accumulate=True)
    return sum(s.value for m in merged for s in m.samples
               if s.name == "rankscope_steps_total" and s.labels.get("rank") == rank)


class Drill:
    """The shared job, and the exporter restarted by drill 1."""

    def __init__(self, job: TrainJob):
        self.job = job
        self.exporter: ExporterProcess | None = None


@pytest.fixture(scope="module")
def drill(tmp_path_factory):
    metrics_dir = tmp_path_factory.mktemp("reliability") / "metrics"
    with TrainJob(nproc=2, steps=1_000_000, env=THRESHOLDS, metrics_dir=metrics_dir, run_id=RUN) as job:
        d = Drill(job)
        job.wait_for(lambda s: steps(s, "0") > 5 and steps(s, "1") > 5, timeout=120, what="both ranks stepping")
        job.health()
        try:
            yield d
        finally:
            if d.exporter:
                d.exporter.stop()


def test_exporter_sigkill_and_restart(drill: Drill):
    """Drill 1. Expectation: with the exporter SIGKILLed the ranks keep
    training (steps in their files keep rising); a new exporter on the same
    port and directory serves every counter at or above its value before the
    kill (no decrease, so rate() sees no reset), and its first scrape's
    gauges are current (heartbeat younger than 2 s, ranks progressing)."""
    job = drill.job
    before = job.scrape()
    old = counters(before, RUN)
    assert len(old) > 50
    os.kill(job.exporter_pid, signal.SIGKILL)
    wait_until(lambda: _refused(job.port), timeout=10, what="exporter gone")
    run_dir = next(job.metrics_dir.glob("*/ranks")).parent
    at_kill = steps_in_files(run_dir, "1")
    wait_until(lambda: steps_in_files(run_dir, "1") > at_kill + 20, timeout=60,
               what="rank 1 stepping while no exporter runs")
    assert job.proc.poll() is None

    drill.exporter = ExporterProcess(job.metrics_dir, port=job.port, env=THRESHOLDS).start()
    job.exporter_pid = drill.exporter.proc.pid
    first = scrape(job.url)
    now = time.time()
    new = counters(first, RUN)
    missing = set(old) - set(new)
    assert not missing, f"series gone after restart: {sorted(missing)[:5]}"
    decreased = {k: (old[k], new[k]) for k in old if new[k] < old[k]}
    assert not decreased, f"counters went down after restart: {list(decreased.items())[:5]}"
    for rank in ("0", "1"):
        beat = value(first, "rankscope_heartbeat_timestamp_seconds", rank=rank)
        assert beat is not None and now - beat < 2.0, (rank, now - (beat or 0))
        assert state(first, rank) == "progressing"
        assert steps(first, rank) > steps(before, rank)
    print(f"drill 1: {len(old)} monotonic series, none decreased; rank 1 made "
          f"{steps(first, '1') - steps(before, '1'):.0f} steps across the restart")


def _refused(port: int) -> bool:
    try:
        http.client.HTTPConnection("127.0.0.1", port, timeout=1).request("GET", "/healthz")
    except ConnectionRefusedError:
        return True
    return False


def test_rank_sigstop_frozen_then_progressing(drill: Drill):
    """Drill 3. Expectation: a SIGSTOPped rank is reported frozen within
    10 s; after SIGCONT it is progressing again and its steps rise."""
    job = drill.job
    pid = job.rank_pids()[1]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        job.wait_for(lambda s: state(s, "1") == "frozen", timeout=10, what="rank 1 frozen")
        frozen_after = time.monotonic() - t0
        at_stop = steps(job.scrape(), "1")
    finally:
        os.kill(pid, signal.SIGCONT)
    t1 = time.monotonic()
    job.wait_for(lambda s: state(s, "1") == "progressing" and steps(s, "1") > at_stop + 5, timeout=60,
                 what="rank 1 progressing after SIGCONT")
    print(f"drill 3: frozen reported {frozen_after:.1f} s after SIGSTOP, "
          f"progressing {time.monotonic() - t1:.1f} s after SIGCONT")


def test_rank_sigkill_reported_dead_counters_kept(drill: Drill):
    """Drill 2 (real job). Expectation: a SIGKILLed rank is reported down
    (rank_up 0, state dead) within 10 s; its counters stay served, unchanged,
    for the whole DEAD_WATCH_S window (no vanishing series, no false rate);
    the exporter keeps serving the job's other rank's series."""
    job = drill.job
    t0 = time.monotonic()
    os.kill(job.rank_pids()[1], signal.SIGKILL)
    samples = job.wait_for(lambda s: s if value(s, "rankscope_rank_up", rank="1") == 0
                           and state(s, "1") == "dead" else None, timeout=10, what="rank 1 dead")
    detected = time.monotonic() - t0
    last = counters([s for s in samples if s.labels.get("rank") == "1"], RUN)
    assert last
    watched = 0
    end = time.monotonic() + DEAD_WATCH_S
    while time.monotonic() < end:
        now = counters([s for s in job.scrape() if s.labels.get("rank") == "1"], RUN)
        assert now == last, "a dead rank's counters changed or vanished"
        watched += 1
        time.sleep(0.5)
    assert value(job.scrape(), "rankscope_rank_up", rank="0") is not None
    job.stop()
    print(f"drill 2: dead reported {detected:.1f} s after SIGKILL; {len(last)} series of the dead rank "
          f"unchanged over {watched} scrapes ({DEAD_WATCH_S:.0f} s)")


def test_next_run_in_same_directory_starts_clean(drill: Drill):
    """Drill 2, continued. Expectation: the next launch with the same run id
    in the same directory (served by the same, still running, exporter)
    counts from zero: after a 40-step run each rank's steps_total is exactly
    40 and there is one rank_info per rank, not the old run's added in."""
    job = drill.job
    assert job.proc.poll() is not None
    with TrainJob(nproc=2, steps=40, env=THRESHOLDS, metrics_dir=job.metrics_dir, run_id=RUN,
                  port=job.port) as second:
        assert second.wait(timeout=180) == 0, second.log()[-2000:]
        samples = second.wait_for(lambda s: s if state(s, "0") == "finished" and state(s, "1") == "finished"
                                  else None, timeout=30, what="second run finished")
        assert steps(samples, "0") == 40 and steps(samples, "1") == 40, (steps(samples, "0"), steps(samples, "1"))
        assert len(select(samples, "rankscope_rank_info", run=RUN)) == 2


def test_dead_rank_others_keep_being_served(tmp_path: Path):
    """Drill 2 (synthetic ranks, no torchrun to tear the others down).
    Expectation: of 4 ranks, the SIGKILLed one is reported down and dead and
    its steps_total stays put; the 3 others stay up, progressing, and their
    steps keep rising."""
    metrics_dir = tmp_path / "metrics"
    with SyntheticRanks(metrics_dir, n=4, run="synthetic") as ranks, \
            ExporterProcess(metrics_dir, env=THRESHOLDS) as exp:
        wait_until(lambda: all(steps(scrape(exp.url), str(r), "synthetic") > 3 for r in range(4)), 30,
                   what="4 synthetic ranks stepping")
        kill(ranks.procs[2])
        dead = wait_until(lambda: (lambda s: s if state(s, "2") == "dead" else None)(scrape(exp.url)), 10,
                          what="rank 2 dead")
        frozen_at = {r: steps(dead, str(r), "synthetic") for r in range(4)}
        wait_until(lambda: all(steps(scrape(exp.url), str(r), "synthetic") > frozen_at[r] + 10 for r in (0, 1, 3)),
                   30, what="the other ranks progressing")
        final = scrape(exp.url)
        assert steps(final, "2", "synthetic") == frozen_at[2]
        assert value(final, "rankscope_rank_up", rank="2") == 0
        assert [value(final, "rankscope_rank_up", rank=str(r)) for r in (0, 1, 3)] == [1, 1, 1]
        assert [state(final, str(r)) for r in (0, 1, 3)] == ["progressing"] * 3


# -- drills 4 and 5: one real Monitor in a loop ----------------------------------
RANK_LOOP = r"""
import sys, time
from rankscope.monitor import Monitor
m = Monitor(run=sys.argv[1], exporter="off")
new_series = sys.argv[2] == "new-series"
events = m.counter("drill_events_total", "One series per step: every step creates a new series.", labels=("n",))
step = 0
while True:
    with m.step(samples=1) as s:
        with s.phase("forward"):
            time.sleep(0.005)
        s.observe(loss=1.0 / (step + 1))
    if new_series:
        events.inc(n=str(step))
    step += 1
    if step % 50 == 0:
        print("step", step, flush=True)
"""


def start_rank_loop(metrics_dir: Path, run: str, mode: str, env: dict[str, str] | None = None,
                    preexec=None) -> subprocess.Popen:
    full = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    full.update({"RANKSCOPE_METRICS_DIR": str(metrics_dir), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    full.update(env or {})
    return subprocess.Popen([sys.executable, "-c", RANK_LOOP, run, mode], cwd=REPO, env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec)


def _tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def _fill(directory: Path) -> Path:
    filler = directory / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    return filler


def test_full_filesystem_training_continues(tmp_path: Path):
    """Drill 4. Expectation: when the metrics filesystem fills up mid-run
    (a 4 MiB tmpfs filled by the test; where mounting is not allowed, a
    RLIMIT_FSIZE on the rank instead), a rank that keeps creating new series
    keeps training (steps rise by 200+ after the first failure, and the
    process is alive), the failures are counted in
    rankscope_telemetry_errors_total{component="user"}, and the log line
    appears once, not once per step. Before the fix in training/publishing/mmapfile.py
    this rank died of SIGBUS."""
    mount = tmp_path / "shm"
    mounted = os.geteuid() == 0 and _tmpfs(mount, "4m")
    metrics_dir = mount / "metrics"
    metrics_dir.mkdir(parents=True)
    preexec = None
    if not mounted:
        import resource

        preexec = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))  # noqa: E731
    proc = start_rank_loop(metrics_dir, "fsfull", "new-series", preexec=preexec)
    try:
        with ExporterProcess(metrics_dir) as exp:
            wait_until(lambda: steps(scrape(exp.url), "0", "fsfull") > 50, 120, what="rank stepping")
            if mounted:
                _fill(mount)
            errors = lambda s: value(s, "rankscope_telemetry_errors_total", component="user") or 0  # noqa: E731
            first = wait_until(lambda: (lambda s: s if errors(s) > 0 else None)(scrape(exp.url)), 60,
                               what="telemetry errors counted")
            wait_until(lambda: steps(scrape(exp.url), "0", "fsfull") > steps(first, "0", "fsfull") + 200, 60,
                       what="training continuing on a full filesystem")
            final = scrape(exp.url)
            assert proc.poll() is None, f"rank died: rc {proc.returncode}"
            assert errors(final) > errors(first)
            beat = value(final, "rankscope_heartbeat_timestamp_seconds", run="fsfull")
            assert time.time() - beat < 2.0
    finally:
        kill(proc)
        err = proc.stderr.read()
        proc.stdout.close()
        proc.stderr.close()
        if mounted:
            subprocess.run(["umount", "-l", str(mount)], check=False)
    assert err.count("telemetry error in user") == 1, err[-3000:]
    print(f"drill 4 ({'full tmpfs' if mounted else 'RLIMIT_FSIZE'}): {errors(final):.0f} failed series "
          f"creations counted, logged once; steps {steps(first, '0', 'fsfull'):.0f} -> "
          f"{steps(final, '0', 'fsfull'):.0f}")


def test_otlp_collector_down_then_up(tmp_path: Path):
    """Drill 5. Expectation: with every step traced and no collector on the
    endpoint, training runs and spans_dropped_total rises; once a collector
    listens there, spans arrive (within 30 s: gRPC reconnect backoff) and the
    drop counter stops rising."""

    port = free_port()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "RANKSCOPE_TRACE_EVERY": "1"}
    metrics_dir = tmp_path / "metrics"
    proc = start_rank_loop(metrics_dir, "otlp", "steps-only", env)
    try:
        with ExporterProcess(metrics_dir) as exp:
            dropped = lambda s: value(s, "rankscope_spans_dropped_total", run="otlp") or 0  # noqa: E731
            down = wait_until(lambda: (lambda s: s if dropped(s) > 0 and steps(s, "0", "otlp") > 50 else None)(
                scrape(exp.url)), 120, what="spans dropped while the collector is down")
            receiver = _receiver_on(port).start()
            try:
                t0 = time.monotonic()
                receiver.wait_for_spans(lambda spans: len(spans) > 20, timeout=30)
                resumed = time.monotonic() - t0
                up = scrape(exp.url)
                arrived = len(receiver.spans())
                receiver.wait_for_spans(lambda spans: len(spans) > arrived + 50, timeout=30)
                assert dropped(scrape(exp.url)) == dropped(up), "spans still dropped with the collector up"
                assert steps(up, "0", "otlp") > steps(down, "0", "otlp")
                assert proc.poll() is None
            finally:
                receiver.stop()
    finally:
        kill(proc)
        proc.stdout.close()
        proc.stderr.close()
    print(f"drill 5: {dropped(up):.0f} spans dropped (counted) while down; spans resumed {resumed:.1f} s "
          f"after the collector came up")


def _receiver_on(port: int):
    """The shared OTLP/gRPC receiver, bound to a chosen port (the collector 'coming back')."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    from tests.helpers import otlp_receiver

    receiver = otlp_receiver.OtlpReceiver()
    receiver._server.stop(None)
    receiver._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(otlp_receiver._TraceService(receiver), receiver._server)
    receiver.port = receiver._server.add_insecure_port(f"127.0.0.1:{port}")
    assert receiver.port == port
    return receiver


# -- drill 8: load ---------------------------------------------------------------
def test_load_50_scrapers_8_ranks(tmp_path: Path):
    """Drill 8. Expectation: 50 concurrent scrapers hitting /metrics for
    LOAD_SECONDS against a node of 8 (synthetic) ranks: every scrape returns
    200 with all 8 ranks in it; p50/p99/max latency is reported."""
    metrics_dir = tmp_path / "metrics"
    with SyntheticRanks(metrics_dir, n=LOAD_RANKS, run="load"), ExporterProcess(metrics_dir) as exp:
        wait_until(lambda: len(select(scrape(exp.url), "rankscope_rank_up", run="load")) == LOAD_RANKS, 30,
                   what="8 ranks served")
        latencies: list[float] = []
        failures: list[str] = []
        lock = threading.Lock()
        end = time.monotonic() + LOAD_SECONDS

        def scraper():
            while time.monotonic() < end:
                t0 = time.monotonic()
                try:
                    conn = http.client.HTTPConnection("127.0.0.1", exp.port, timeout=30)
                    conn.request("GET", "/metrics")
                    resp = conn.getresponse()
                    body = resp.read()
                    conn.close()
                    ok = resp.status == 200 and body.count(b"rankscope_rank_up{") == LOAD_RANKS
                    error = None if ok else f"status {resp.status}, {body.count(b'rankscope_rank_up{')} ranks"
                except Exception as e:   # a failed scrape is the finding, not a test crash
                    error = repr(e)
                with lock:
                    (failures.append(error) if error else latencies.append(time.monotonic() - t0))

        threads = [threading.Thread(target=scraper) for _ in range(LOAD_SCRAPERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(LOAD_SECONDS + 60)
        assert exp.proc.poll() is None
    latencies.sort()
    n = len(latencies)
    p = lambda q: latencies[min(n - 1, int(q * n))] * 1000  # noqa: E731
    print(f"drill 8: {n} scrapes by {LOAD_SCRAPERS} scrapers in {LOAD_SECONDS:.0f} s ({n / LOAD_SECONDS:.0f}/s), "
          f"{len(failures)} failed; latency p50 {p(0.5):.0f} ms, p99 {p(0.99):.0f} ms, max {latencies[-1] * 1000:.0f} ms")
    assert not failures, failures[:5]
    assert n > LOAD_SCRAPERS
