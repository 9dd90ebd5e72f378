"""The per-process-group series on the rank's metrics (rankscope.publishing.metrics.RankMetrics):
what the process-groups reader (rankscope.collectives.group_reader) writes through
``ProcessGroupSink`` (rankscope.collectives.protocols)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rankscope.collectives.protocols import Counting, Observing, Setting

if TYPE_CHECKING:
    from rankscope.publishing.metrics import RankMetrics


class ProcessGroupMetrics:
    """The per-process-group children, bound on first use of a (group, op)."""

    def __init__(self, rank_metrics: RankMetrics):
        self._rm = rank_metrics
        self._durations: dict[tuple[str, str], Observing] = {}

    def _child(self, name: str, **labels: str):
        return self._rm.child(self._rm.family(name), labels)

    def process_group_counters(self, group: str, group_id: str, op: str) -> tuple[Counting, Counting, Counting]:
        return (self._child("rankscope_process_group_collectives_total", group=group, group_id=group_id, op=op),
                self._child("rankscope_process_group_collective_bytes_total", group=group, group_id=group_id, op=op),
                self._child("rankscope_process_group_collective_bus_bytes_total", group=group, group_id=group_id,
                            op=op))

    def process_group_seq(self, group: str, group_id: str) -> tuple[Setting, Setting]:
        return (self._child("rankscope_process_group_last_enqueued_seq", group=group, group_id=group_id),
                self._child("rankscope_process_group_last_completed_seq", group=group, group_id=group_id))

    def process_group_in_flight(self, group: str, group_id: str, op: str) -> Setting:
        return self._child("rankscope_process_group_in_flight_started_timestamp_seconds", group=group,
                           group_id=group_id, op=op)

    def process_group_duration(self, group: str, op: str) -> Observing:
        child = self._durations.get((group, op))
        if child is None:
            child = self._durations[(group, op)] = self._child(
                "rankscope_process_group_collective_duration_seconds", group=group, op=op)
        return child
