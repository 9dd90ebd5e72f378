"""The entries of a flight recorder's ring, each counted once: what an entry says (its op, its
message size), where the reader is in each ring (``Cursor``), and ``EntryCounter``, which
decodes the entries not counted before into their groups' series.

The ring arrives whole, as torch serialises it (JSON, keys sorted: 10 us per entry, 20 ms for a
full ring, docs/collectives.md); only the entries not read before are decoded here, one at a
time, giving the GIL back at least every ``GIL_SLICE_S``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rankscope.collectives.group_table import GroupTable
from rankscope.collectives.protocols import ProcessGroupSink
from rankscope.collectives.tracker import bus_factor

GIL_SLICE_S = 0.00025        # decode entries for at most this long before giving the GIL back
MAX_IN_FLIGHT = 1024         # in-flight collectives remembered per group
_ENTRY_START = b'{"collective_seq_id":'   # nlohmann::json sorts keys: every entry starts so
_LAST_ENTRY_MAX = 1 << 16    # bytes decoded for the ring's last entry (an entry is ~0.5 KB; 2 KB with frames)

# Bytes per element of the dtype names the flight recorder writes (c10::ScalarType names).
_DTYPE_BYTES = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Byte": 1,
                "Char": 1, "Bool": 1, "ComplexFloat": 8, "ComplexDouble": 16, "ComplexHalf": 4, "UInt16": 2,
                "UInt32": 4, "UInt64": 8}


def op_of(profiling_name: str) -> str:
    """``gloo:all_reduce``, ``nccl:_allgather_base``, ``nccl:reduce_scatter_tensor_coalesced`` ... -> an op of
    PROCESS_GROUP_OPS."""
    name = profiling_name.split(":", 1)[-1].strip().split(" ", 1)[0].lower().lstrip("_")
    compact = name.replace("_", "")
    for prefix, op in (("allreduce", "all_reduce"), ("allgather", "all_gather"), ("reducescatter", "reduce_scatter"),
                       ("alltoall", "all_to_all"), ("broadcast", "broadcast"), ("barrier", "barrier"),
                       ("send", "send"), ("recv", "recv"), ("reduce", "reduce"), ("gather", "gather"),
                       ("scatter", "scatter")):
        if compact.startswith(prefix):
            return op
    return "other"


def entry_nbytes(entry: dict, op: str) -> int:
    """Message size as nccl-tests counts it: all_gather the gathered output, everything else the input."""
    sizes, dtypes = ((entry.get("output_sizes"), entry.get("output_dtypes")) if op == "all_gather"
                     else (entry.get("input_sizes"), entry.get("input_dtypes")))
    total = 0
    for i, shape in enumerate(sizes or ()):
        numel = 1
        for d in shape:
            numel *= d
        dtype = dtypes[i] if dtypes and i < len(dtypes) else (dtypes[-1] if dtypes else "Float")
        total += numel * (1 if dtype.startswith("Float8") else _DTYPE_BYTES.get(dtype, 0))
    return total


@dataclass
class Cursor:
    """Where the reader is in one recorder's ring, and what it saw there last (record ids
    and pg ids are the recorder's own)."""

    recorder: str
    last_record: int = -1                               # record_id of the last entry counted
    pending_duration: dict = field(default_factory=dict)   # record_id -> (group label, op) read before done
    unretired: dict = field(default_factory=dict)          # record_id -> (pg_id, seq): collectives read in flight
    last_entries: float = 0.0                           # monotonic time of the last entries read
    enqueued_at_read: int = 0                           # collectives the status counted at that read
    read_s: float = 0.0                                 # wall seconds the last entries read took
    suspect: dict = field(default_factory=dict)         # pg_id -> seq seen in flight at the last status read
    status: dict = field(default_factory=dict)          # pg_id -> the last status read


class EntryCounter:
    """Counts the entries of a recorder's ring not counted before (``Cursor``) into their
    groups (``GroupTable``): collectives and bytes per op, durations (``metrics``), the
    entries' own sequence numbers and what is in flight. ``drop(what, reason, n)`` counts the
    entries lost: overwritten in the ring before they were read, or of a group over the budget."""

    def __init__(self, table: GroupTable, metrics: ProcessGroupSink, drop: Callable[..., None]):
        self._table = table
        self._m = metrics
        self._drop = drop
        self.longest_slice_s = 0.0                  # the longest the decoder held the GIL between yields (wall)
        self.longest_slice_cpu_s = 0.0              # ... of which its own CPU time
        self.entries_read = 0

    def count_new(self, cursor: Cursor, body: bytes | bytearray) -> None:
        """Counts the entries of ``body`` (the recorder's whole ring as JSON) not counted yet."""
        start = self._first_new_entry(cursor, body)
        if start < 0:
            return
        # Entry by entry, each a small slice of the body decoded on its own: nothing here
        # costs more than one entry's worth of work between two GIL yields. Wall time
        # between yields is how long the GIL was held (a descheduled holder keeps it);
        # thread CPU time is how much of that was this work.
        slice_start, slice_cpu = time.perf_counter(), time.thread_time()
        decoder = json.JSONDecoder()
        at = start
        while at >= 0:
            following = body.find(_ENTRY_START, at + 1)
            chunk = body[at:following if following >= 0 else at + _LAST_ENTRY_MAX].decode("utf-8", "replace")
            entry, _ = decoder.raw_decode(chunk)
            self._count(cursor, entry)
            self.entries_read += 1
            at = following
            elapsed = time.perf_counter() - slice_start
            if elapsed >= GIL_SLICE_S:
                self._note_slice(elapsed, time.thread_time() - slice_cpu)
                time.sleep(0)   # let the training thread have the GIL
                slice_start, slice_cpu = time.perf_counter(), time.thread_time()
        self._note_slice(time.perf_counter() - slice_start, time.thread_time() - slice_cpu)
        self._table.use_collective_numbers(cursor.recorder)

    def _note_slice(self, wall: float, cpu: float) -> None:
        self.longest_slice_s = max(self.longest_slice_s, wall)
        self.longest_slice_cpu_s = max(self.longest_slice_cpu_s, cpu)

    def _first_new_entry(self, cursor: Cursor, body: bytes) -> int:
        """Offset of the first entry not counted yet (entries are in record order), or -1 if none.
        A gap (entries overwritten in the ring before they were read) is counted by ``_count``."""
        begin = body.find(b'"entries":[')
        if begin < 0:
            return -1
        begin += len(b'"entries":[')
        if body[begin:begin + 1] != b"{":
            return -1
        if cursor.last_record < 0:
            return begin
        first = min(min(cursor.pending_duration, default=cursor.last_record + 1),
                    min(cursor.unretired, default=cursor.last_record + 1))
        at = body.find(b'"record_id":%d,' % first, begin)
        if at < 0 and (cursor.pending_duration or cursor.unretired):   # overwritten before done: give up on them
            cursor.pending_duration.clear()
            cursor.unretired.clear()
            at = body.find(b'"record_id":%d,' % (cursor.last_record + 1), begin)
        if at >= 0:
            return body.rfind(_ENTRY_START, begin, at)
        last = body.rfind(b'"record_id":')
        newest = int(re.match(rb'"record_id":(\d+)', body[last:last + 40]).group(1))
        if newest == cursor.last_record:
            return -1
        if newest < cursor.last_record:   # the recorder was reset: its ids start over
            cursor.last_record = -1
        return begin

    def _count(self, cursor: Cursor, entry: dict) -> None:
        record = int(entry.get("record_id", -1))
        if record <= cursor.last_record:
            self._late_duration(cursor, record, entry)
            return
        if cursor.last_record >= 0 and record > cursor.last_record + 1:
            self._drop("flight_recorder", "entries overwritten in the ring before they were read",
                       record - cursor.last_record - 1)
        cursor.last_record = record
        pg_id = str(entry.get("pg_id"))
        group = self._table.group(cursor.recorder, pg_id, entry.get("process_group") or ("", ""), cursor.status)
        if group is None:
            self._drop("process_group", f"more than {self._table.max_groups} process groups on this rank")
            return
        op = op_of(entry.get("profiling_name", ""))
        count, nbytes, bus_nbytes = self._table.series(group, op)
        count.inc()
        size = entry_nbytes(entry, op)
        nbytes.inc(size)
        if group.size and op != "other":
            bus_nbytes.inc(size * bus_factor(op, group.size))
        duration_ms = entry.get("duration_ms")
        if duration_ms is not None:
            self._m.process_group_duration(group.label, op).observe(float(duration_ms) / 1000.0)
        elif not entry.get("retired") and entry.get("profiling_name", "").startswith("nccl:"):
            # NCCL's watchdog writes the duration (collective timing on) when it retires the work,
            # a watchdog period after the read's own copy of the entry saw it complete
            # (time_discovered_completed_ns): read this entry again until it is retired.
            if len(cursor.pending_duration) >= MAX_IN_FLIGHT:
                cursor.pending_duration.pop(min(cursor.pending_duration))
            cursor.pending_duration[record] = (group.label, op)
        seq = int(entry.get("collective_seq_id", 0))
        if entry.get("is_p2p"):
            group.counts_p2p = True   # NCCL records its p2p work: the status counts it too
            return
        group.collective_enqueued = max(group.collective_enqueued, seq)
        if entry.get("retired"):
            group.collective_completed = max(group.collective_completed, seq)
        else:   # read again until it is retired: the completed number of a group that counts p2p
            if len(cursor.unretired) >= MAX_IN_FLIGHT:
                cursor.unretired.pop(min(cursor.unretired))
            cursor.unretired[record] = (pg_id, seq)
        # In flight: not retired (its own word), or after the group's completed number (NCCL retires a
        # watchdog period after completion); pruned by that number as it moves (GroupTable.publish).
        if not entry.get("retired") or seq > group.completed:
            if len(group.in_flight) >= MAX_IN_FLIGHT:   # completions not seen: keep the newest
                del group.in_flight[min(group.in_flight)]
            group.in_flight[seq] = (op, int(entry.get("time_created_ns", 0)) / 1e9)

    def _late_duration(self, cursor: Cursor, record: int, entry: dict) -> None:
        """An entry read before its work completed: its completion and its duration, once the
        backend wrote them."""
        unretired = cursor.unretired.get(record)
        if unretired is not None and entry.get("retired"):
            del cursor.unretired[record]
            group = self._table.groups.get((cursor.recorder, unretired[0]))
            if group is not None:
                group.collective_completed = max(group.collective_completed, unretired[1])
        pending = cursor.pending_duration.get(record)
        if pending is None:
            return
        duration_ms = entry.get("duration_ms")
        if duration_ms is not None:
            self._m.process_group_duration(*pending).observe(float(duration_ms) / 1000.0)
            del cursor.pending_duration[record]
        elif entry.get("retired"):   # retired without one: timing is off
            del cursor.pending_duration[record]
