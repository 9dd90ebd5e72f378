"""Doubles of the process-groups reader's two collaborators (rankscope.collectives.protocols):
torch 2.13's flight recorders serialised as fr_trace_json, and a metrics sink keeping values."""

from __future__ import annotations

import json

from rankscope.collectives.group_reader import ProcessGroupReader


class Child:
    def __init__(self):
        self.value = 0.0
        self.observed: list[float] = []

    def inc(self, n=1.0):
        self.value += n

    def set(self, v):
        self.value = v

    def observe(self, v):
        self.observed.append(v)


class Sink:
    """ProcessGroupMetrics' interface, keeping values."""

    def __init__(self):
        self.children: dict[tuple, Child] = {}

    def _c(self, *key):
        return self.children.setdefault(key, Child())

    def process_group_counters(self, group, group_id, op):
        return (self._c("count", group, group_id, op), self._c("bytes", group, group_id, op),
                self._c("bus_bytes", group, group_id, op))

    def process_group_seq(self, group, group_id):
        return self._c("enqueued", group, group_id), self._c("completed", group, group_id)

    def process_group_in_flight(self, group, group_id, op):
        return self._c("in_flight", group, group_id, op)

    def process_group_duration(self, group, op):
        return self._c("duration", group, op)


class FakeRecorder:
    """A flight recorder ring of ``size`` entries, serialised as torch 2.13's fr_trace_json."""

    def __init__(self, size=2000):
        self.size = size
        self.entries: list[dict] = []
        self.status: dict[str, dict[str, str]] = {}
        self.next_record = 0
        self.seq: dict[int, int] = {}

    def collective(self, pg_id=0, name="0", desc="default_pg", op="gloo:all_reduce", numel=4, complete=True,
                   t=1000.0, **extra):
        seq = self.seq[pg_id] = self.seq.get(pg_id, 0) + 1
        entry = {"collective_seq_id": seq, "input_dtypes": ["Float"], "input_sizes": [[numel]], "is_p2p": False,
                 "op_id": seq, "output_dtypes": ["Float"], "output_sizes": [[numel]], "p2p_seq_id": 0,
                 "pg_id": pg_id, "process_group": [name, desc], "profiling_name": op,
                 "record_id": self.next_record, "retired": True, "state": "scheduled", "thread_id": "1",
                 "thread_name": "python", "time_created_ns": int(t * 1e9), "time_discovered_completed_ns": 0,
                 "time_discovered_started_ns": 0, "timeout_ms": 1800000, **extra}
        self.next_record += 1
        self.entries = (self.entries + [entry])[-self.size:]
        s = self.status.setdefault(str(pg_id), {"last_completed_collective": "-1", "last_enqueued_collective": "-1",
                                                "last_started_collective": "-1"})
        s["last_enqueued_collective"] = str(seq)
        if complete:
            s["last_completed_collective"] = str(seq)

    def complete(self, pg_id=0):
        s = self.status[str(pg_id)]
        s["last_completed_collective"] = s["last_enqueued_collective"]

    def entries_json(self) -> bytes:
        doc = {"comm_lib_version": "", "entries": self.entries, "nccl_comm_state": {}, "pg_config": {},
               "pg_status": self.status, "version": "2.10"}
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    def close(self):
        pass


class Source:
    """FlightRecorderSource's interface over fake recorders, by name."""

    def __init__(self, **recorders: FakeRecorder):
        self.by_name = recorders
        self.recorders = tuple(recorders)

    def status(self, recorder):
        return self.by_name[recorder].status

    def entries_json(self, recorder):
        return self.by_name[recorder].entries_json()

    def close(self):
        pass


def make():
    rec = FakeRecorder()
    source = Source(cpu=rec)
    sink, drops, errors = Sink(), [], []
    reader = ProcessGroupReader(sink, lambda what, reason="", n=1: drops.append((what, n)), lambda: errors.append(1),
                                source, 2, 60.0, entries_every_s=0.0, initialized=lambda: True,
                                default_recorder=lambda: "cpu")
    reader._ring = 0   # no pacing: every poll reads the entries
    return rec, reader, sink, drops, errors
