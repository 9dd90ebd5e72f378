"""What the process-groups reader needs from its two collaborators, as small Protocols.

* ``RingSource``: the flight recorders' reads (rankscope.collectives.ring_source.FlightRecorderSource;
  a test's fake recorders);
* ``ProcessGroupSink``: the per-process-group series (rankscope.collectives.group_metrics.ProcessGroupMetrics;
  a test's sink keeping values). Each returns bound children of prometheus_client metrics:
  ``Counting`` (a counter's), ``Setting`` (a gauge's), ``Observing`` (a histogram's).
"""

from __future__ import annotations

from typing import Protocol


class Counting(Protocol):
    def inc(self, amount: float = 1) -> None: ...


class Setting(Protocol):
    def set(self, value: float) -> None: ...


class Observing(Protocol):
    def observe(self, amount: float) -> None: ...


class RingSource(Protocol):
    """The two reads of each flight recorder, by name (``recorders``). A source may also say
    ``holds_gil(recorder)``: whether reading that recorder's entries holds the GIL throughout
    (the reader takes a source without it for one that never does)."""

    recorders: tuple[str, ...]

    def status(self, recorder: str) -> dict[str, dict[str, str]]:
        """Per pg_id: its last enqueued / completed collective (``pg_status``)."""
        ...

    def entries_json(self, recorder: str) -> bytes | bytearray:
        """The whole ring as JSON, as torch serialises it (keys sorted)."""
        ...

    def close(self) -> None: ...


class ProcessGroupSink(Protocol):
    """The children of the per-process-group series, bound on first use of a (group, op)."""

    def process_group_counters(self, group: str, group_id: str, op: str) -> tuple[Counting, Counting, Counting]:
        """Collectives, bytes and bus bytes of ``op`` on the group."""
        ...

    def process_group_seq(self, group: str, group_id: str) -> tuple[Setting, Setting]:
        """The group's last enqueued and last completed sequence numbers."""
        ...

    def process_group_in_flight(self, group: str, group_id: str, op: str) -> Setting:
        """When the oldest ``op`` still in flight on the group was enqueued (0: none)."""
        ...

    def process_group_duration(self, group: str, op: str) -> Observing: ...
