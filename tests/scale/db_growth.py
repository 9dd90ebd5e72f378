"""Exporter file growth: scrape time when 1,000 dead rank processes left their
prometheus_client multiprocess .db files in one run directory, and the
exporter's compaction of them (rankscope.exporter.compaction), which keeps
every count.

    .venv/bin/python -m tests.scale.db_growth --dead 1000

The rank side writes one ``<type>_<pid>.db`` per process and metric type
(prometheus_client multiprocess mode) and the exporter merges every file of a
run on each scrape, so each restarted process adds files the scrape would
read forever (client_python #367). Here 8 live rank processes (real sleeping
processes, registered as a Monitor registers) and N dead ones (registered
with pids that cannot exist, as one torchrun agent's restarts) each write a
rank's counters and histograms (steps, six phases, step-time histogram with
18 buckets, collective bytes) through prometheus_client itself, with their
own process identifier. Then, for

- ``clean``: the 8 live processes' files alone;
- ``grown``: live + N dead processes' files and registrations;
- ``compacted``: ``grown`` after ``Compactor.compact_run`` (what the
  exporter's janitor runs once a process has been dead ``--compact-after``
  seconds): the dead processes' counters and histograms folded into one file
  per type under the launch's oldest dead process, the other dead
  registrations removed,

it measures prometheus_client's merge of the files and the exporter's own
scrape (``NodeCollector`` + the /metrics renderer, warm, as a running
exporter serves), and checks that the merged samples after compaction equal
those before (counts exactly, float sums to 1e-12) and that the exporter
serves the same counters.
"""

from __future__ import annotations

import argparse
import glob
import os
import resource
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram, values
from prometheus_client.multiprocess import MultiProcessCollector

from rankscope.contract.rundir import Registration, load_registrations, process_start_ticks
from rankscope.exporter.collector import NodeCollector
from rankscope.exporter.compaction import Compactor
from rankscope.exporter.config import ExporterConfig
from rankscope.exporter.exposition import Renderer

PHASES = ("data", "forward", "backward", "optimizer", "comm_wait", "other")
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75,
           1.0, 1.5, 2.5)


GONE = 2**22 + 1   # above any Linux pid_max: a process that cannot exist


def write_process(directory: Path, pid: str, rank: int, steps: int) -> None:
    """One rank process's files, written by prometheus_client with ``pid`` as its identifier."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
    values.ValueClass = values.MultiProcessValue(process_identifier=lambda: pid)
    reg = CollectorRegistry()
    ident = {"run": "growth", "rank": str(rank), "local_rank": str(rank % 8), "node": "node-0000"}
    names = list(ident)
    steps_total = Counter("rankscope_steps_total", "steps", names, registry=reg)
    phase = Counter("rankscope_phase_seconds_total", "phase", names + ["phase"], registry=reg)
    step_time = Histogram("rankscope_step_duration_seconds", "step", names, buckets=BUCKETS, registry=reg)
    coll = Counter("rankscope_collective_bytes_total", "bytes", names + ["op"], registry=reg)
    steps_total.labels(**ident).inc(steps)
    for i, p in enumerate(PHASES):
        phase.labels(**ident, phase=p).inc(steps * 0.01 * (i + 1))
    for k in range(steps % 50 + 1):
        step_time.labels(**ident).observe(0.05 + 0.001 * k)
    coll.labels(**ident, op="all_reduce").inc(steps * 4096)


def merge_seconds(files: list[str], repeat: int) -> tuple[float, list]:
    times, merged = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        merged = MultiProcessCollector.merge(files, accumulate=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), merged


def samples(merged) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in merged for s in m.samples}


def register(directory: Path, rank: int, pid: int, ticks: int | None, agent: int, started: float) -> None:
    Registration(run="growth", rank=rank, local_rank=rank % 8, node="node-0000", world_size=8, local_world_size=8,
                 pid=pid, pid_start_ticks=ticks, agent_pid=agent, agent_start_ticks=process_start_ticks(agent),
                 started_at=started).save(directory)


def scrape_seconds(metrics_dir: Path, repeat: int) -> tuple[float, float, dict]:
    """The exporter's scrape of ``metrics_dir``: first (every key parsed) and warm (median), and the
    counters it serves."""
    collector = NodeCollector(ExporterConfig(directory=metrics_dir, node="node-0000", nvml=False))
    renderer = Renderer()

    class One:
        def collect(self):
            return collector.collect()

    t0 = time.perf_counter()
    renderer.render(One())
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        renderer.render(One())
        times.append(time.perf_counter() - t0)
    counters = {(s.name, tuple(sorted(s.labels.items()))): s.value for m in collector.collect() for s in m.samples
                if s.labels.get("run") == "growth" and s.name.endswith(("_total", "_sum", "_count", "_bucket"))}
    return first, statistics.median(times), counters


def compare(b: dict, a: dict) -> tuple[bool, bool]:
    """Counts (steps, bucket counts) identical; float sums (seconds, bytes) equal to 1e-12."""
    counts = [k for k in b if k[0] in ("rankscope_steps_total",) or k[0].endswith(("_bucket", "_count"))]
    exact = b.keys() == a.keys() and bool(counts) and all(b[k] == a[k] for k in counts)
    close = b.keys() == a.keys() and all(math.isclose(b[k], a[k], rel_tol=1e-12) for k in b)
    return exact, close


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dead", type=int, default=1000, help="dead rank processes that left files")
    ap.add_argument("--repeat", type=int, default=11)
    args = ap.parse_args(argv)
    # Each simulated process's files stay mapped (as in a real process): ~3 descriptors each.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * args.dead + 256)), hard))
    work = Path(tempfile.mkdtemp(prefix="rankscope-dbgrowth-"))
    sleepers = []
    try:
        parent = os.getpid()
        for _ in range(8):   # the node's current 8 rank processes: real, alive (until this script goes)
            pid = os.fork()
            if pid == 0:
                while os.getppid() == parent:
                    time.sleep(0.5)
                os._exit(0)
            sleepers.append(pid)
        clean, grown = work / "clean" / "growth", work / "grown" / "growth"
        clean.mkdir(parents=True)
        grown.mkdir(parents=True)
        agent, t0 = os.getpid(), time.time() - 3600
        for i in range(args.dead):   # the 8 ranks restarted many times: each old process keeps its counts
            write_process(grown, str(GONE + i), i % 8, 100 + i)
            register(grown, i % 8, GONE + i, 1, agent, t0 + i)
        for rank, pid in enumerate(sleepers):
            for directory in (clean, grown):
                write_process(directory, str(pid), rank, 1000)
                register(directory, rank, pid, process_start_ticks(pid), agent, time.time())
        files_grown = sorted(glob.glob(str(grown / "*.db")))
        registrations_grown = len(load_registrations(grown))
        t_clean, _ = merge_seconds(sorted(glob.glob(str(clean / "*.db"))), args.repeat)
        t_grown, before = merge_seconds(files_grown, args.repeat)
        s_clean_first, s_clean, _ = scrape_seconds(clean.parent, args.repeat)
        s_grown_first, s_grown, served_before = scrape_seconds(grown.parent, args.repeat)
        c0 = time.perf_counter()
        done = Compactor(0).compact_run(grown)
        compaction_s = time.perf_counter() - c0
        files_compacted = sorted(glob.glob(str(grown / "*.db")))
        t_compacted, after = merge_seconds(files_compacted, args.repeat)
        s_compacted_first, s_compacted, served_after = scrape_seconds(grown.parent, args.repeat)
        exact, close = compare(samples(before), samples(after))
        served_exact, served_close = compare(served_before, served_after)
        report = {"dead_processes": args.dead, "files_grown": len(files_grown), "files_compacted": len(files_compacted),
                  "files_removed": done.files_removed if done else 0, "compaction_s": compaction_s,
                  "registrations_grown": registrations_grown,
                  "registrations_compacted": len(load_registrations(grown)),
                  "merge_clean_s": t_clean, "merge_grown_s": t_grown, "merge_compacted_s": t_compacted,
                  "grown_vs_clean": t_grown / t_clean, "compacted_vs_clean": t_compacted / t_clean,
                  "scrape_clean_s": s_clean, "scrape_grown_s": s_grown, "scrape_compacted_s": s_compacted,
                  "scrape_first_clean_s": s_clean_first, "scrape_first_grown_s": s_grown_first,
                  "scrape_first_compacted_s": s_compacted_first,
                  "scrape_grown_vs_clean": s_grown / s_clean, "scrape_compacted_vs_clean": s_compacted / s_clean,
                  "series": len(samples(before)), "counts_identical": exact and served_exact,
                  "sums_within_1e-12": close and served_close, "loadavg": os.getloadavg()}
        print(json.dumps(report, indent=1))
        return 0 if exact and close and served_exact and served_close else 1
    finally:
        for pid in sleepers:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
