"""Rank 0's TensorBoard / MLflow summary (rankscope.sinks.summary) on values as the exporter gives
them, and the page it reads them from: the figures are the rules' (compute per step over the peers'
median), events are written once, MFU and goodput only from the series they come from. No processes."""

from __future__ import annotations

import math

import pytest

from rankscope.pages import RankRecord
from rankscope.sinks.summary import TAG as T
from rankscope.sinks.summary import Summarizer, parse_page


def _rank(steps: float, dur: float, compute: float, comm: float, loss: float, ts: float, **kw) -> RankRecord:
    phases = {"forward": compute, "backward": 0.0, "optimizer": 0.0, "comm_wait": comm, "data": 0.0,
              "other": dur - compute - comm}   # phases add up to the step time
    return RankRecord(steps=steps, dur_sum=dur, dur_count=steps, phases=phases, loss=loss, step=steps - 1,
                      step_ts=ts, start_ts=100.0, pids=frozenset({"1"}), state="progressing", **kw)


def test_summary_of_two_scrapes():
    s = Summarizer()
    assert s.update({0: _rank(10, 1.0, 0.2, 0.5, 2.0, 1000.0), 1: _rank(10, 1.0, 0.7, 0.0, 2.2, 1000.0)}) is None
    rec = s.update({0: _rank(30, 3.0, 0.6, 1.5, 1.0, 1002.0), 1: _rank(30, 3.2, 2.1, 0.0, 1.4, 1002.0)})
    assert rec is not None and rec.step == 29
    sc = rec.scalars
    assert sc[T + "step_time/min"] == pytest.approx(0.1) and sc[T + "step_time/max"] == pytest.approx(0.11)
    # compute per step over the 20 steps, as the straggler rule reads it: rank 1 70 ms, rank 0 20 ms
    assert sc[T + "slowest_rank"] == 1 and sc[T + "straggler_ratio"] == pytest.approx(0.070 / 0.020)
    assert sc[T + "comm_wait_fraction"] == pytest.approx(1.0 / 4.2)
    assert sc[T + "comm_wait_fraction/max"] == pytest.approx(0.5)
    assert sc[T + "loss/spread"] == pytest.approx(0.4) and sc[T + "loss/std"] == pytest.approx(0.2)
    assert sc[T + "throughput/steps_per_s"] == pytest.approx(10.0)
    # MFU and goodput only from the series they come from: absent here, so never written.
    assert T + "mfu" not in sc and T + "goodput" not in sc
    assert rec.events == []


def test_straggler_ratio_is_over_the_peers_median_within_each_stage():
    """Three ranks at 20, 30 and 60 ms: the rule's 60 / median(20, 30) = 2.4, not 60 / 30 (the run's
    median, which holds the straggler). A pipeline stage is judged against its own ranks only."""
    s = Summarizer()
    first = {k: _rank(10, 1.0, 0.0, 0.0, 2.0, 1000.0) for k in range(5)}
    s.update(first)
    second = {0: _rank(20, 2.0, 0.2, 0.0, 2.0, 1001.0), 1: _rank(20, 2.0, 0.3, 0.0, 2.0, 1001.0),
              2: _rank(20, 2.0, 0.6, 0.0, 2.0, 1001.0)}
    rec = s.update(second)
    assert rec.scalars[T + "slowest_rank"] == 2 and rec.scalars[T + "straggler_ratio"] == pytest.approx(2.4)
    # Stage "b" does twice the work of stage "a" (1.0 s against 0.5 s a step): no straggler among them;
    # rank 4, at 1.3x its stage's other rank, is the slowest.
    staged = {0: ("a", 0.5), 1: ("a", 0.5), 2: ("b", 1.0), 3: ("b", 1.0), 4: ("b", 1.3)}
    s = Summarizer()
    s.update({k: _rank(10, 20.0, 0.0, 0.0, 2.0, 1000.0, stage=st) for k, (st, _) in staged.items()})
    rec = s.update({k: _rank(20, 40.0, 10 * c, 0.0, 2.0, 1010.0, stage=st) for k, (st, c) in staged.items()})
    assert rec.scalars[T + "slowest_rank"] == 4 and rec.scalars[T + "straggler_ratio"] == pytest.approx(1.3)


def test_a_rank_without_peers_is_the_slowest_with_no_ratio():
    s = Summarizer()
    s.update({0: _rank(10, 1.0, 0.2, 0.0, 2.0, 1000.0)})
    rec = s.update({0: _rank(20, 2.0, 0.4, 0.0, 2.0, 1001.0)})
    assert rec.scalars[T + "slowest_rank"] == 0 and T + "straggler_ratio" not in rec.scalars


def test_summary_events_restarts_and_counter_resets():
    s = Summarizer()
    s.update({0: _rank(10, 1.0, 0.2, 0.0, 2.0, 1000.0), 1: _rank(10, 1.0, 0.2, 0.0, 2.0, 1000.0)})
    r0 = _rank(20, 2.0, 0.4, 0.0, float("nan"), 1001.0, nonfinite=2.0, oom=1.0)
    r1 = _rank(3, 0.3, 0.06, 0.0, 2.0, 1001.0)            # counters restarted from 0: a new process
    r1.start_ts, r1.pids = 200.0, frozenset({"1", "2"})
    rec = s.update({0: r0, 1: r1})
    assert rec.scalars[T + "events/nonfinite"] == 2 and rec.scalars[T + "events/oom"] == 1
    assert rec.scalars[T + "events/restarts"] == 1
    assert rec.scalars[T + "step_time/max"] == pytest.approx(0.1)   # the reset counter's 3 steps, 0.3 s
    assert rec.scalars[T + "loss/spread"] == 0                       # the NaN loss is an event, not a spread
    text = "\n".join(rec.events)
    assert "rank 0: 2 step(s) with a non-finite" in text and "rank 0: 1 out-of-memory" in text
    assert "rank 1 restarted (process 2)" in text


def test_summary_hang_is_written_once_at_the_step_reached():
    s = Summarizer()
    ok = {0: _rank(10, 1.0, 0.2, 0.0, 2.0, 1000.0), 1: _rank(10, 1.0, 0.2, 0.0, 2.0, 1000.0)}
    s.update(ok)
    assert s.update(ok) is not None      # the first record at this step
    assert s.update(ok) is None          # nothing new: not written again
    hung = {0: _rank(10, 1.0, 0.2, 0.0, 2.0, 1000.0), 1: _rank(10, 1.0, 0.2, 0.0, 2.0, 1000.0)}
    hung[0].state, hung[1].state, hung[1].hang_suspect = "stuck_in_collective", "stuck", True
    rec = s.update(hung)
    assert rec.step == 9 and rec.scalars[T + "ranks/stalled"] == 2 and rec.scalars[T + "events/hang_suspects"] == 1
    assert any("rank 1 is the hang suspect" in e for e in rec.events)
    assert s.update(hung) is None


def test_summary_mfu_and_goodput_when_published():
    s = Summarizer()
    a = _rank(10, 1.0, 0.2, 0.0, 2.0, 1000.0, flops=1e12, peak_flops=1e12, wall={"productive": 5.0, "idle": 5.0})
    s.update({0: a})
    b = _rank(20, 2.0, 0.4, 0.0, 2.0, 1002.0, flops=2e12, peak_flops=1e12, wall={"productive": 8.0, "idle": 6.0})
    rec = s.update({0: b})
    assert rec.scalars[T + "mfu"] == pytest.approx(0.5)       # 1e12 FLOPs in 2 s on a 1e12 FLOP/s device
    assert rec.scalars[T + "goodput"] == pytest.approx(3.0 / 4.0)


def test_parse_page_keeps_only_this_runs_ranks():
    page = "\n".join([
        '# TYPE rankscope_steps_total counter',
        'rankscope_steps_total{local_rank="0",node="n",rank="0",run="a \\"b\\""} 5.0',
        'rankscope_steps_total{local_rank="0",node="n",rank="0",run="other"} 7.0',
        'rankscope_step_duration_seconds_bucket{le="0.1",local_rank="0",node="n",rank="0",run="a \\"b\\""} 5.0',
        'rankscope_rank_state{local_rank="0",node="n",rank="0",run="a \\"b\\"",state="progressing"} 1.0',
        'rankscope_rank_info{local_rank="0",node="n",process_id="42",rank="0",run="a \\"b\\""} 1.0',
        'rankscope_rank_layout_info{local_rank="0",mesh="",node="n",rank="0",run="a \\"b\\"",stage="1",tp_group=""} 1.0',
        'rankscope_loss{local_rank="0",node="n",rank="0",run="a \\"b\\""} NaN',
    ])
    ranks = parse_page(page, 'a "b"')
    assert list(ranks) == [0]
    r = ranks[0]
    assert r.steps == 5 and r.state == "progressing" and r.pids == {"42"} and math.isnan(r.loss)
    assert r.stage == "1" and r.buckets == {}   # the summary reads no buckets: their lines are not parsed
