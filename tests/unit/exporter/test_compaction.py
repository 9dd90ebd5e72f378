"""Compaction of dead rank processes' files (rankscope.exporter.compaction).

In-process tests write real files through prometheus_client (a chosen process
identifier per simulated process, as tests/unit/exporter/test_reader.py does) with
registrations of processes that are gone, and check that what the exporter
serves is the same before and after compaction, that prometheus_client's own
merge reads the compacted files, that a new launch still removes them, and
that a scrape running during compactions never sees a count twice or not at
all. The integration test restarts 120 short-lived real processes writing
through RankMetrics and reads the real exporter over HTTP before and after it
compacts.
"""

from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.multiprocess import MultiProcessCollector

from rankscope.contract.rundir import (Registration, load_registrations, process_start_ticks, remove_previous_launch)
from rankscope.exporter.compaction import Compactor
from rankscope.exporter.config import ExporterConfig
from rankscope.exporter.ranks import RankCollector
from rankscope.exporter.reader import Reader
from tests.unit.exporter.test_reader import Proc, canon, files_of

GONE = 2**22 + 1000          # above any pid_max: processes that are gone
MONOTONIC = ("_total", "_count", "_sum", "_bucket")


def register(run_dir: Path, rank: int, pid: int, ticks, agent: int, agent_ticks, started: float) -> Registration:
    reg = Registration(run="r", rank=rank, local_rank=rank, node="n", world_size=4, local_world_size=4, pid=pid,
                       pid_start_ticks=ticks, agent_pid=agent, agent_start_ticks=agent_ticks, started_at=started)
    reg.save(run_dir)
    return reg


def build_run(run_dir: Path, dead_per_rank: int = 5, ranks: int = 4) -> dict[int, Proc]:
    """Ranks 0..ranks-1 restarted ``dead_per_rank`` times by two launches' agents (both gone); rank 0's newest
    process is this one (alive)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    procs = {}
    t0 = time.time() - 1000
    for k in range(dead_per_rank):
        for rank in range(ranks):
            pid = GONE + 100 * k + rank
            agent = GONE + 50_000 + (k % 2)            # two agents: two groups
            register(run_dir, rank, pid, 777, agent, 1, t0 + 10 * k + rank)
            p = procs[pid] = Proc(run_dir, str(pid))
            p.write(str(rank), k + 1.25 * rank)
            p.child(p.gauges["mostrecent"], run="r", rank=f"only-{pid}").set(pid)   # a series of one process
    me = os.getpid()
    register(run_dir, 0, me, process_start_ticks(me), 1, process_start_ticks(1), time.time())
    live = procs[me] = Proc(run_dir, str(me))
    live.write("0", 99)
    return procs


AGES = ("rankscope_step_stalled_seconds", "rankscope_heartbeat_age_seconds", "rankscope_collective_in_flight_seconds")


def served(collector: RankCollector) -> dict:
    """Every series of run r the exporter serves, but the ages it derives from the clock."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in collector.collect() for s in m.samples
            if s.labels.get("run") == "r" and m.name not in AGES}


def assert_same_counts(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for key, value in before.items():
        if key[0].endswith(MONOTONIC) and float(value).is_integer():
            assert after[key] == value, key            # counts: exact
        elif math.isnan(value):
            assert math.isnan(after[key]), key
        else:
            assert after[key] == pytest.approx(value, rel=1e-12, abs=0), key   # float sums: the last bit


def test_compaction_keeps_what_is_served(tmp_path):
    run_dir = tmp_path / "r"
    build_run(run_dir)
    collector = RankCollector(ExporterConfig(directory=tmp_path, nvml=False))
    before = served(collector)
    files_before = files_of(run_dir)
    assert len(load_registrations(run_dir)) == 21
    done = Compactor(0).compact_run(run_dir)
    assert done is not None and not done.aborted, done
    after = served(collector)
    assert_same_counts(before, after)
    assert {k for k in before if k[0] == "t_gauge_mostrecent"} == {k for k in after if k[0] == "t_gauge_mostrecent"}
    # Each launch's 10 dead processes are now one file per type (counter, histogram, summary, mostrecent gauge),
    # under its keeper's pid; the dead processes' live gauges are gone; all, min, max, sum gauges stay.
    names = [Path(f).name for f in files_of(run_dir)]
    for keeper in (GONE, GONE + 100):
        for kind in ("counter", "histogram", "summary", "gauge_mostrecent"):
            assert f"{kind}_{keeper}.db" in names
    assert not any(n.startswith("gauge_live") and not n.endswith(f"_{os.getpid()}.db") for n in names)
    assert len(names) < len(files_before)
    # prometheus_client reads the compacted files, and the reader agrees with it sample for sample.
    paths = files_of(run_dir)
    assert canon(Reader().merge(run_dir, paths)) == canon(MultiProcessCollector.merge(paths, accumulate=True))
    # Registrations: the keepers, the newest process of each rank, and the processes that still have files
    # (their all/min/max/sum gauges).
    kept = {(r.rank, r.pid) for r in load_registrations(run_dir)}
    assert (0, os.getpid()) in kept and (0, GONE) in kept and (0, GONE + 100) in kept
    # A second pass has nothing left to do.
    assert Compactor(0).compact_run(run_dir) is None
    assert served(collector) == after


def test_only_processes_dead_long_enough_are_compacted(tmp_path):
    run_dir = tmp_path / "r"
    build_run(run_dir, dead_per_rank=2, ranks=2)
    compactor = Compactor(compact_after_s=60)
    now = time.time()
    assert compactor.compact_runs([run_dir], now=now) == {}        # first seen dead now
    assert compactor.compact_runs([run_dir], now=now + 30) == {}
    done = compactor.compact_runs([run_dir], now=now + 61)
    assert done[run_dir].processes == 4


def test_a_new_launch_still_removes_a_compacted_launch(tmp_path):
    run_dir = tmp_path / "r"
    build_run(run_dir, dead_per_rank=3, ranks=2)
    Compactor(0).compact_run(run_dir)
    # A torchelastic restart by one of the old agents (same agent) keeps its compacted counts ...
    remove_previous_launch(run_dir, GONE + 50_000, 1)
    assert (run_dir / f"counter_{GONE}.db").exists()
    # ... a new launch removes every dead launch's files, compacted ones included.
    me = os.getpid()
    remove_previous_launch(run_dir, 1, process_start_ticks(1))
    left = [Path(f).name for f in files_of(run_dir)]
    assert left and all(name.endswith(f"_{me}.db") for name in left)
    assert {r.pid for r in load_registrations(run_dir)} == {me}


def test_a_scrape_never_sees_a_count_twice_or_not_at_all(tmp_path):
    """Scrapes under the exporter's lock, in a loop, while restarted processes die and are compacted."""
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    lock = threading.Lock()
    collector = RankCollector(ExporterConfig(directory=tmp_path, nvml=False))
    compactor = Compactor(0)
    expected = {"n": 0}
    bad: list = []
    stop = threading.Event()

    def total() -> float:
        with lock:
            return sum(s.value for m in collector.collect() if m.name == "t_ops"
                       for s in m.samples if s.labels["rank"] == "x")

    scrapes = []

    def scrape() -> None:
        while not stop.is_set():
            low = expected["n"]
            got = total()
            if not low <= got <= expected["n"]:
                bad.append((low, got, expected["n"]))
            scrapes.append(got)
            time.sleep(0.0005)   # Python's lock is not fair: without a pause the writer waits for seconds

    me = os.getpid()
    register(run_dir, 0, me, process_start_ticks(me), 1, process_start_ticks(1), time.time() + 10_000)
    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        for k in range(60):
            pid = GONE + k
            register(run_dir, 1, pid, 777, GONE + 9999, 1, time.time())
            p = Proc(run_dir, str(pid))
            with lock:   # a process's inc lands between two scrapes
                p.child(p.counter, run="r", rank="x", op="o").inc(k + 1)
                expected["n"] += k + 1
            if k % 3 == 2:
                compactor.compact_run(run_dir, lock)
            time.sleep(0.003)   # let scrapes land between the writer's steps
    finally:
        stop.set()
        scraper.join()
    assert not bad, bad[:5]
    assert len(scrapes) > 60, "the scraper must have raced the writer"
    assert total() == expected["n"] == sum(range(1, 61))
    assert len(files_of(run_dir)) <= 4


# -- the real exporter, real short-lived processes ------------------------------------------

FARM = r"""
import os, sys, time
from pathlib import Path
from rankscope.contract.catalog import RANK_INFO_LABELS
from rankscope.contract.rundir import Registration, process_start_ticks
from rankscope.publishing.metrics import RankMetrics

run_dir, n = Path(sys.argv[1]), int(sys.argv[2])
run_dir.mkdir(parents=True, exist_ok=True)
agent = os.getpid()
for i in range(n):
    pid = os.fork()
    if pid == 0:
        me = os.getpid()
        rank = i % 8
        reg = Registration(run="farm", rank=rank, local_rank=rank, node="n", world_size=8, local_world_size=8,
                           pid=me, pid_start_ticks=process_start_ticks(me), agent_pid=agent,
                           agent_start_ticks=process_start_ticks(agent), started_at=time.time())
        reg.save(run_dir)
        m = RankMetrics(run_dir, {"run": "farm", "rank": str(rank), "local_rank": str(rank), "node": "n"})
        m.set_rank_info({**dict.fromkeys(RANK_INFO_LABELS, ""), "process_id": str(me)})
        m.steps.inc(i + 1)
        m.samples.inc(64 * (i + 1))
        for d in (0.01, 0.2, 3.0):
            m.step_duration.observe(d * (1 + i % 3))
        m.collective("all_reduce").bytes.inc(4096 * (i + 1))
        m.observed["loss"].set(1.0 / (i + 1))
        m.heartbeat.set(time.time())
        os._exit(0)
    os.waitpid(pid, 0)
print("done", flush=True)
"""


