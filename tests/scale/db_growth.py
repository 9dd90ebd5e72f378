"""Exporter file growth: merge time of prometheus_client multiprocess .db files
when 1,000 dead rank processes left theirs in one run directory, and a
compaction of the dead processes' files that keeps every count.

    .venv/bin/python -m tests.scale.db_growth --dead 1000

The rank side writes one ``<type>_<pid>.db`` per process and metric type
(prometheus_client multiprocess mode); the exporter merges every file of a
run on each scrape (``MultiProcessCollector.merge(files, accumulate=True)``
in rankscope/exporter/ranks.py), so each restarted process adds files the
scrape reads forever (client_python #367). Here every simulated process
writes a rank's counters and histograms (steps, six phases, step-time
histogram with 18 buckets, collective bytes) through prometheus_client
itself, with its own process identifier. Then:

- ``clean``: the merge time of the live process's files alone;
- ``grown``: live + N dead processes' files;
- ``compacted``: live + ONE file per type holding the dead processes'
  merged counters and histograms (what ``compact()`` below writes),

and checks that the merged samples of ``compacted`` equal those of
``grown`` exactly. The exporter does not compact yet (another area's
change); this is the measurement and the proposed algorithm.
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
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector

PHASES = ("data", "forward", "backward", "optimizer", "comm_wait", "other")
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75,
           1.0, 1.5, 2.5)


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


def compact(directory: Path, dead_pids: set[str], into: str = "compacted") -> int:
    """Merge the dead processes' counter and histogram files into one ``<type>_<into>.db``
    per type (the merge sums them, so the sums are kept) and delete theirs. Returns files removed.

    Gauges are left alone: a dead process's live gauges are already left out by the
    exporter, and ``all``-mode gauges carry the pid as a label.
    """
    removed = 0
    for kind in ("counter", "histogram"):
        dead = [f for f in glob.glob(str(directory / f"{kind}_*.db")) if Path(f).stem.split("_", 1)[1] in dead_pids]
        target = directory / f"{kind}_{into}.db"
        sources = dead + ([str(target)] if target.exists() else [])
        if not dead:
            continue
        # accumulate=False: the raw per-bucket counts, as they are stored (merge would make them cumulative).
        merged = MultiProcessCollector.merge(sources, accumulate=False)
        tmp = directory / f".{kind}_{into}.db.tmp"
        out = MmapedDict(str(tmp))
        try:
            for metric in merged:
                for s in metric.samples:
                    names = tuple(s.labels)
                    key = mmap_key(metric.name, s.name, names, tuple(s.labels[n] for n in names), metric.documentation)
                    out.write_value(key, s.value, 0.0)
        finally:
            out.close()
        tmp.replace(target)  # atomic: a scrape sees the old files or the new one, never half
        for f in dead:
            Path(f).unlink()
            removed += 1
    return removed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dead", type=int, default=1000, help="dead rank processes that left files")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    # Each simulated process's files stay mapped (as in a real process): ~3 descriptors each.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * args.dead + 256)), hard))
    work = Path(tempfile.mkdtemp(prefix="rankscope-dbgrowth-"))
    try:
        clean, grown = work / "clean", work / "grown"
        clean.mkdir()
        grown.mkdir()
        for rank in range(8):  # the node's current 8 rank processes
            write_process(clean, f"live{rank}", rank, 1000)
            write_process(grown, f"live{rank}", rank, 1000)
        for i in range(args.dead):  # the 8 ranks restarted many times: each old process keeps its counts
            write_process(grown, f"dead{i}", i % 8, 100 + i)
        files_grown = sorted(glob.glob(str(grown / "*.db")))
        t_clean, _ = merge_seconds(sorted(glob.glob(str(clean / "*.db"))), args.repeat)
        t_grown, before = merge_seconds(files_grown, args.repeat)
        removed = compact(grown, {f"dead{i}" for i in range(args.dead)})
        files_compacted = sorted(glob.glob(str(grown / "*.db")))
        t_compacted, after = merge_seconds(files_compacted, args.repeat)
        b, a = samples(before), samples(after)
        # Counts (steps, bucket counts) must be identical; float sums (seconds, bytes) may
        # differ in the last bits only, as the files are summed in another order.
        counts = [k for k in b if k[0] in ("rankscope_steps_total",) or k[0].endswith(("_bucket", "_count"))]
        exact = b.keys() == a.keys() and bool(counts) and all(b[k] == a[k] for k in counts)
        close = b.keys() == a.keys() and all(math.isclose(b[k], a[k], rel_tol=1e-12) for k in b)
        same = exact and close
        report = {"dead_processes": args.dead, "files_grown": len(files_grown), "files_compacted": len(files_compacted),
                  "files_removed": removed, "merge_clean_s": t_clean, "merge_grown_s": t_grown,
                  "merge_compacted_s": t_compacted, "grown_vs_clean": t_grown / t_clean,
                  "compacted_vs_clean": t_compacted / t_clean, "series": len(b),
                  "counts_identical": exact, "sums_within_1e-12": close}
        print(json.dumps(report, indent=1))
        return 0 if same else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
