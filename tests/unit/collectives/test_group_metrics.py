"""rankscope.collectives.group_metrics: the per-process-group series on a real RankMetrics, each
bound with its group, group_id and op labels beside the rank's identity."""

from __future__ import annotations

from rankscope.collectives.group_metrics import ProcessGroupMetrics
from rankscope.publishing.metrics import RankMetrics

IDENTITY = {"run": "groups", "rank": "0", "local_rank": "0", "node": "n"}


def _samples(metrics: RankMetrics, family: str, sample: str) -> dict[tuple, float]:
    """sample's values by their labels other than the rank's identity."""
    return {tuple(sorted((k, v) for k, v in s.labels.items() if k not in IDENTITY)): s.value
            for m in metrics.family(family).collect() for s in m.samples if s.name == sample}


def test_each_series_is_bound_with_its_group_and_op(tmp_path):
    metrics = RankMetrics(tmp_path, IDENTITY)
    series = ProcessGroupMetrics(metrics)
    count, nbytes, bus_nbytes = series.process_group_counters("dp_shard", "1", "all_gather")
    count.inc()
    nbytes.inc(4096)
    bus_nbytes.inc(2048)
    enqueued, completed = series.process_group_seq("dp_shard", "1")
    enqueued.set(7)
    completed.set(6)
    series.process_group_in_flight("dp_shard", "1", "all_gather").set(1234.0)
    series.process_group_duration("dp_shard", "all_gather").observe(0.5)
    series.process_group_duration("dp_shard", "all_gather").observe(1.5)

    op = (("group", "dp_shard"), ("group_id", "1"), ("op", "all_gather"))
    seq = (("group", "dp_shard"), ("group_id", "1"))
    for family, value in (("rankscope_process_group_collectives_total", 1.0),
                          ("rankscope_process_group_collective_bytes_total", 4096.0),
                          ("rankscope_process_group_collective_bus_bytes_total", 2048.0)):
        assert _samples(metrics, family, family) == {op: value}, family
    assert _samples(metrics, "rankscope_process_group_last_enqueued_seq",
                    "rankscope_process_group_last_enqueued_seq") == {seq: 7.0}
    assert _samples(metrics, "rankscope_process_group_last_completed_seq",
                    "rankscope_process_group_last_completed_seq") == {seq: 6.0}
    assert _samples(metrics, "rankscope_process_group_in_flight_started_timestamp_seconds",
                    "rankscope_process_group_in_flight_started_timestamp_seconds") == {op: 1234.0}
    # Durations: by group and op only (no group_id), one child per (group, op), bound once.
    assert _samples(metrics, "rankscope_process_group_collective_duration_seconds",
                    "rankscope_process_group_collective_duration_seconds_count") == {
        (("group", "dp_shard"), ("op", "all_gather")): 2.0}
    assert series.process_group_duration("dp_shard", "all_gather") is \
        series.process_group_duration("dp_shard", "all_gather")
