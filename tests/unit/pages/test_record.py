"""One record per rank (rankscope.pages.record), the same from an exporter's page and from a
Prometheus instant query of the same series. No processes."""

from __future__ import annotations

import math

from rankscope.contract.states import RANK_STATES
from rankscope.pages import Series, parse, records, run_records

IDENT = 'local_rank="0",node="n1",rank="0",run="r"'
PAGE = "\n".join([
    "# TYPE rankscope_steps_total counter",
    f"rankscope_steps_total{{{IDENT}}} 30.0",
    f'rankscope_steps_total{{local_rank="1",node="n1",rank="1",run="r"}} 28.0',
    f'rankscope_steps_total{{local_rank="0",node="n2",rank="x",run="r"}} 1.0',   # not a rank number: left out
    f"rankscope_step{{{IDENT}}} 29.0",
    f"rankscope_loss{{{IDENT}}} NaN",
    f'rankscope_phase_seconds_total{{{IDENT},phase="forward"}} 1.5',
    f'rankscope_phase_seconds_total{{{IDENT},phase="comm_wait"}} 0.5',
    f'rankscope_step_duration_seconds_bucket{{{IDENT},le="0.1"}} 20.0',
    f'rankscope_step_duration_seconds_bucket{{{IDENT},le="+Inf"}} 30.0',
    f'rankscope_nonfinite_total{{{IDENT},what="loss"}} 1.0',
    f'rankscope_nonfinite_total{{{IDENT},what="grad"}} 2.0',
    *[f'rankscope_rank_state{{{IDENT},state="{s}"}} {1.0 if s == "stuck" else 0.0}' for s in RANK_STATES],
    f"rankscope_hang_suspect{{{IDENT}}} 1.0",
    f"rankscope_rank_up{{{IDENT}}} 1.0",
    f'rankscope_rank_info{{{IDENT},process_id="42"}} 1.0',
    f'rankscope_rank_info{{{IDENT},process_id="43"}} 1.0',
    f'rankscope_rank_layout_info{{{IDENT},mesh="pp=9",stage="9",tp_group=""}} 0.0',
    f'rankscope_rank_layout_info{{{IDENT},mesh="pp=1",stage="1",tp_group=""}} 1.0',
    f'rankscope_rank_failure_info{{{IDENT},exception="RuntimeError"}} 1.0',
    f'rankscope_evidence_captured_timestamp_seconds{{{IDENT},path="/evidence/x",scheme="http",trigger="stuck"}} 5.0',
    f'rankscope_collective_in_flight{{{IDENT},op="all_reduce"}} 1.0',
    f'rankscope_collective_in_flight_seconds{{{IDENT},op="all_reduce"}} 12.5',
    f"rankscope_device_memory_total_bytes{{{IDENT}}} 0.0",
    f"rankscope_host_memory_rss_bytes{{{IDENT}}} 1048576.0",
    f'rankscope_steps_total{{local_rank="0",node="n1",rank="0",run="other"}} 7.0',
]) + "\n"


def test_a_page_gives_one_record_per_rank_of_each_run():
    by_run = records(parse(PAGE))
    assert sorted(by_run) == ["other", "r"] and sorted(by_run["r"]) == [0, 1]
    r = by_run["r"][0]
    assert (r.run, r.rank, r.node, r.steps, r.step) == ("r", 0, "n1", 30.0, 29.0)
    assert math.isnan(r.loss) and r.nonfinite == 3.0
    assert r.phases == {"forward": 1.5, "comm_wait": 0.5} and r.buckets == {0.1: 20.0, math.inf: 30.0}
    assert r.state == "stuck" and r.hang_suspect and r.up and r.exception == "RuntimeError"
    assert r.pids == {"42", "43"} and r.stage == "1"          # the layout it has now, not one it had
    assert r.evidence == "stuck" and r.in_flight == {"all_reduce": 1.0} and r.in_flight_s == {"all_reduce": 12.5}
    assert r.device_memory_total == 0.0 and r.host_memory_rss == 1048576.0
    other = by_run["r"][1]
    assert other.state is None and other.up is None and other.stage == "" and other.steps == 28.0


def test_a_prometheus_vector_of_the_same_series_gives_the_same_record():
    samples = parse(PAGE)
    scraped = [Series(s.name, {**s.labels, "job": "rankscope", "instance": "n1:9400"}, s.value) for s in samples]
    a, b = run_records(samples, "r")[0], run_records(scraped, "r")[0]
    assert repr(a) == repr(b)   # NaN loss included


def test_only_the_lines_a_reader_asks_for_are_parsed():
    samples = parse(PAGE, {"rankscope_steps_total"}, "r")
    assert {s.name for s in samples} == {"rankscope_steps_total"} and {s.labels["run"] for s in samples} == {"r"}
    assert run_records(samples, "r")[0].phases == {}
