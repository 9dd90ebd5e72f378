"""Issue 3: collective timing on gloo, and hangs that name their culprit."""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import statistics
import subprocess
import sys
import time

from tests.helpers.jobs import REPO, TrainJob, select, value, wait_until

# Short exporter thresholds for the test run (the production defaults are 30/10/10 s).
FAST_STATES = {"RANKSCOPE_STUCK_AFTER_S": "5", "RANKSCOPE_FROZEN_AFTER_S": "4", "RANKSCOPE_SUSPECT_AFTER_S": "5"}


def test_explicit_all_reduce_duration_agrees_with_wall_clock(tmp_path):
    env = {**os.environ, "RANKSCOPE_METRICS_DIR": str(tmp_path / "metrics"), "CALLS": "25", "PYTHONPATH": str(REPO),
           "RESULTS_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(REPO / "tests/scripts/collective_accuracy.py")], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank-*.json"))]
    assert len(results) == 2
    for result in results:
        ratios = [recorded / direct for recorded, direct in result["pairs"]]
        assert len(ratios) >= 20
        median = statistics.median(ratios)
        print(f"rank {result['rank']}: median recorded/direct = {median:.4f} over {len(ratios)} 16 MiB all_reduces")
        assert 0.8 <= median <= 1.25
        ops = dict(result["ops"])
        assert set(ops) == {"all_gather", "reduce_scatter", "broadcast", "barrier"}
        assert ops["all_gather"] == ops["reduce_scatter"] == 2 * 1024 * 4 and ops["barrier"] == 0


def _hang_started(job: TrainJob, rank: int) -> float:
    line = wait_until(lambda: re.search(rf"rank {rank}: injected hang at step \d+", job.log()), timeout=120,
                      what=f"rank {rank} to hang")
    assert line
    return time.monotonic()


def test_hung_rank_is_named_while_its_peers_wait_in_all_reduce():
    env = {**FAST_STATES, "TORCH_FR_BUFFER_SIZE": "200", "RANKSCOPE_FLIGHT_RECORDER_AFTER_S": "3"}
    with TrainJob(nproc=3, steps=100_000, extra_args=["--hang-at", "30", "--fault-rank", "2"], env=env) as job:
        hung_at = _hang_started(job, 2)

        def peers_waiting_and_suspect_named(s):
            waits = [value(s, "rankscope_collective_in_flight_seconds", rank=r, op="all_reduce") or 0
                     for r in ("0", "1")]
            return (all(w > 0 for w in waits)
                    and value(s, "rankscope_hang_suspect", rank="2") == 1
                    and value(s, "rankscope_hang_suspect", rank="0") == 0
                    and value(s, "rankscope_hang_suspect", rank="1") == 0) and (s, waits)

        samples, waits = job.wait_for(peers_waiting_and_suspect_named, timeout=20,
                                      what="peers in all_reduce and rank 2 named the suspect")
        print(f"suspect named {time.monotonic() - hung_at:.1f} s after the hang began")
        assert time.monotonic() - hung_at <= 20
        for r in ("0", "1"):
            assert value(samples, "rankscope_collective_in_flight", rank=r, op="all_reduce") == 1
            assert value(samples, "rankscope_collective_started_timestamp_seconds", rank=r, op="all_reduce") > 0
        assert all(s.value == 0 for s in select(samples, "rankscope_collective_in_flight", rank="2"))
        assert all(s.value == 0 for s in select(samples, "rankscope_collective_in_flight_seconds", rank="2"))
        # The wait keeps growing; the ranks reach their stuck states.
        later = job.wait_for(lambda s: all((value(s, "rankscope_collective_in_flight_seconds", rank=r,
                                                  op="all_reduce") or 0) > w + 1 for r, w in zip(("0", "1"), waits))
                             and value(s, "rankscope_rank_state", rank="2", state="stuck") == 1 and s,
                             timeout=20, what="growing wait and stuck states")
        for r in ("0", "1"):
            assert value(later, "rankscope_rank_state", rank=r, state="stuck_in_collective") == 1
        assert value(later, "rankscope_rank_up", rank="2") == 1   # alive and heartbeating: hung, not dead
        # The waiting ranks left torch's flight recorder where the runbook says to look.
        dumps = {r: next(job.metrics_dir.glob(f"*/flight-recorder/nccl_trace_rank_{r}"), None) for r in (0, 1)}
        assert all(dumps.values()), dumps
        for path in dumps.values():
            trace = pickle.loads(path.read_bytes())
            names = [e.get("profiling_name") for e in trace["entries"]]
            assert "gloo:all_reduce" in names, names[-5:]
            assert any(e.get("state") != "completed" for e in trace["entries"])   # the stuck one
        assert not list(job.metrics_dir.glob("*/flight-recorder/nccl_trace_rank_2"))  # in no collective


def test_sigstop_is_frozen_not_stuck_and_sigcont_resumes():
    with TrainJob(nproc=2, steps=100_000, extra_args=["--step-delay", "0.01"], env=FAST_STATES) as job:
        job.wait_for(lambda s: (value(s, "rankscope_steps_total", rank="1") or 0) > 10, timeout=90)
        pid = job.rank_pids()[1]
        os.kill(pid, signal.SIGSTOP)
        try:
            frozen = job.wait_for(lambda s: value(s, "rankscope_rank_state", rank="1", state="frozen") == 1 and s,
                                  timeout=15, what="rank 1 frozen")
            assert value(frozen, "rankscope_rank_state", rank="1", state="stuck") == 0
            assert value(frozen, "rankscope_rank_up", rank="1") == 1
            # Its peer blocks in the next all-reduce: after the threshold the
            # stopped rank is the suspect, the waiting one is not.
            job.wait_for(lambda s: value(s, "rankscope_hang_suspect", rank="1") == 1
                         and value(s, "rankscope_hang_suspect", rank="0") == 0, timeout=20, what="suspect rank 1")
        finally:
            os.kill(pid, signal.SIGCONT)
        before = value(job.scrape(), "rankscope_steps_total", rank="1")
        job.wait_for(lambda s: value(s, "rankscope_rank_state", rank="1", state="progressing") == 1
                     and value(s, "rankscope_rank_state", rank="0", state="progressing") == 1
                     and value(s, "rankscope_steps_total", rank="1") > before, timeout=20,
                     what="both ranks progressing again")
