"""Every collective of every process group, read from torch's flight recorder.

FSDP2, DTensor / tensor parallel, pipeline schedules and user code on
sub-groups issue collectives that no rankscope wrapper sees. torch (>= 2.7)
records every collective of every process group, gloo and NCCL alike, in its
flight recorder (a ring of ``TORCH_FR_BUFFER_SIZE`` entries, 2000 by default
in torch 2.13). This module reads it from a background thread
(``rankscope-process-groups``) and publishes, per process group:

* collectives and bytes per op (``rankscope_process_group_collectives_total``,
  ``..._collective_bytes_total``);
* the last enqueued and last completed sequence number
  (``..._last_enqueued_seq``, ``..._last_completed_seq``): ranks of one group
  issue the same sequence, so a rank whose last enqueued number is behind its
  peers' while they wait is where a hang starts (prometheus rules,
  RankscopeCollectiveBehind);
* per op, when the oldest collective still in flight was enqueued
  (``..._in_flight_started_timestamp_seconds``);
* durations where the backend measured them (NCCL with collective timing on:
  the entry's ``duration_ms``); gloo records none.

Why two reads, and what each costs (measured, docs/collectives.md):

* the **status** (``_dump_fr_trace_json(False, False)``: per group the last
  enqueued / completed sequence number) is a few microseconds and is read
  every ``interval_s``;
* the **entries** (op, sizes, dtypes, enqueue time) are 10 us per entry to
  serialise, 20 ms for a full ring, all of it under the GIL if called from
  Python. So they are fetched from torch's own C++ worker server
  (``torch._C._distributed_c10d._WorkerServer``, handler ``fr_trace_json``) on
  a unix socket in the run directory: the ring is serialised on the server's
  C++ thread without the GIL, and only the entries not read before are
  decoded here, one at a time, giving the GIL back at least every
  ``GIL_SLICE_S``. When about half the ring is new, as the status's sequence
  numbers count (between 1 and 10 s apart), and at once when a collective has stayed in flight across two
  status reads (a possible hang: its op and age are wanted now).

Group labels: ``group`` is the role, ``default`` for the default group, the
device-mesh dimension name for a mesh's groups (DeviceMesh names them
``mesh_<dim>``), the group's own description where the user gave one, else
``pg<name>``; ``group_id`` is the group's name, which torch makes the same on
every member rank. At most ``max_groups`` groups per rank are published; the
collectives of any further group are counted as dropped (``process_group``).
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("rankscope")

GIL_SLICE_S = 0.00025        # decode entries for at most this long before giving the GIL back
ENTRIES_EVERY_S = 1.0        # read new flight-recorder entries at least this far apart (and on a possible hang)
ENTRIES_AT_MOST_EVERY_S = 10.0   # ... and at most this far apart
RING_SHARE = 0.5             # aim to read when about this share of the ring is new
MAX_IN_FLIGHT = 1024         # in-flight collectives remembered per group
MAX_LABEL = 32               # characters of a group label taken from a description
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


def group_label(name: str, desc: str) -> str:
    """The bounded, readable role of a group (see the module docstring)."""
    if desc == "default_pg" or name == "0" and desc in ("", "undefined"):
        return "default"
    role = desc[len("mesh_"):] if desc.startswith("mesh_") else desc
    if role in ("", "undefined", "default"):
        return "pg" + re.sub(r"[^a-z0-9_]", "_", name.lower())[:MAX_LABEL]
    return re.sub(r"[^a-z0-9_]", "_", role.lower())[:MAX_LABEL]


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
class Group:
    pg_id: str
    name: str
    label: str
    series: dict = field(default_factory=dict)         # op -> (count child, bytes child)
    in_flight: dict = field(default_factory=dict)      # seq -> (op, unix seconds enqueued)
    published_in_flight: dict = field(default_factory=dict)   # op -> start last written
    enqueued: int = -1
    completed: int = -1
    seq_children: tuple = ()


class FlightRecorderSource:
    """The two reads of torch's flight recorder; replaceable in tests."""

    def __init__(self, socket_dir: Path, rank: int):
        self._socket_dir = socket_dir
        self._rank = rank
        self._server: Any = None
        self._path = ""

    def status(self) -> dict[str, dict[str, str]]:
        import torch

        raw = torch._C._distributed_c10d._dump_fr_trace_json(False, False)
        return json.loads(raw).get("pg_status", {})

    def entries_json(self) -> bytes:
        """The whole ring as JSON, serialised by torch's C++ worker server (no GIL held meanwhile)."""
        if self._server is None:
            self._start()
        conn = _UnixHTTPConnection(self._path)
        try:
            conn.request("POST", "/handler/fr_trace_json")
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise OSError(f"flight recorder server answered {resp.status}")
            return body
        finally:
            conn.close()

    def _start(self) -> None:
        from torch._C._distributed_c10d import _WorkerServer

        path = self._socket_dir / f"fr-{self._rank}-{os.getpid()}.sock"
        if len(str(path)) > 100:   # sun_path holds 108 bytes
            path = Path(tempfile.mkdtemp(prefix="rankscope-fr-")) / "fr.sock"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        self._server = _WorkerServer(str(path))
        os.chmod(path, 0o600)   # the server also answers stack dumps: this user only
        self._path = str(path)

    def close(self) -> None:
        if self._server is not None:
            try:
                self._server.shutdown()
            finally:
                self._server = None
                Path(self._path).unlink(missing_ok=True)


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str):
        super().__init__("localhost", timeout=5.0)
        self._unix_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._unix_path)


class ProcessGroupReader:
    """Reads the flight recorder and writes the per-process-group series (see the module docstring).

    ``metrics`` provides ``process_group_series(label, group_id, op)`` etc. (rankscope.metrics);
    ``drop(what, reason, n)`` and ``error()`` count what goes wrong."""

    def __init__(self, metrics: Any, drop: Callable[..., None], error: Callable[[], None], source: Any,
                 max_groups: int, interval_s: float, entries_every_s: float = ENTRIES_EVERY_S,
                 initialized: Callable[[], bool] | None = None,
                 on_in_flight: Callable[[float], None] | None = None, timing: bool = False):
        self._m = metrics
        self._drop = drop
        self._error = error
        self._source = source
        self._max_groups = max_groups
        self._interval_s = interval_s
        self._entries_every_s = entries_every_s
        self._initialized = initialized or _dist_initialized
        self._on_in_flight = on_in_flight   # called with the oldest enqueue time in flight (flight-recorder dump)
        self._timing = timing               # turn on each process group's collective timing (NCCL durations)
        self._timed_groups: set[str] = set()
        self.groups: dict[str, Group] = {}          # pg_id -> Group
        self._refused: set[str] = set()             # pg_ids over the budget
        self._last_record = -1                      # record_id of the last entry counted
        self._last_entries = 0.0
        self._enqueued_at_read = 0
        self._ring = _ring_size()
        self._suspect: dict[str, int] = {}          # pg_id -> seq seen in flight at the last status read
        self._status: dict[str, dict[str, str]] = {}
        self._pending_duration: dict[int, tuple[str, str]] = {}   # record_id -> (group, op) read before done
        self._warned_off = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rankscope-process-groups", daemon=True)
        self.longest_slice_s = 0.0                  # the longest the decoder held the GIL between yields (wall)
        self.longest_slice_cpu_s = 0.0              # ... of which its own CPU time
        self.entries_read = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout_s)
        self.poll(final=True)
        try:
            self._source.close()
        except Exception:
            self._error()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.poll()

    def poll(self, final: bool = False) -> None:
        if not self._lock.acquire(timeout=1.0):
            return
        try:
            if not self._initialized():
                return
            if self._timing:
                self._enable_timing()
            status = self._status = self._source.status()
            if not status:
                self._warn_if_recorder_off()
            stuck = self._note_status(status)
            now = time.monotonic()
            enqueued = sum(int(st.get("last_enqueued_collective", -1)) + 1 for st in status.values())
            # A group not known yet has no labels: its sequence numbers wait for its entries.
            unknown = any(pg_id not in self.groups and pg_id not in self._refused for pg_id in status)
            if final or stuck or self._read_due(now, enqueued - self._enqueued_at_read, unknown):
                self._last_entries, self._enqueued_at_read = now, enqueued
                try:   # without entries the sequence numbers are still published
                    self._read_entries()
                except Exception:
                    self._error()
            self._publish()
        except Exception:
            self._error()
        finally:
            self._lock.release()

    def _read_due(self, now: float, new_collectives: int, unknown_group: bool = False) -> bool:
        """Serialising the ring costs the same however few entries are new (about 10 us an entry,
        on torch's thread): read once about half of it is new, as the groups' sequence numbers
        count, but no closer than entries_every_s and no further than ENTRIES_AT_MOST_EVERY_S apart.
        A busy FSDP job is read every second or few; a DDP job with a few collectives a second
        every ten."""
        since = now - self._last_entries
        if since < self._entries_every_s:
            return False
        return (since >= ENTRIES_AT_MOST_EVERY_S or self._ring <= 0 or unknown_group
                or new_collectives >= RING_SHARE * self._ring)

    def _enable_timing(self) -> None:
        """RANKSCOPE_COLLECTIVE_TIMING=1: every process group times its collectives (NCCL: two CUDA
        events each, read by NCCL's watchdog into the recorder's duration_ms). Groups created since
        the last poll get it now; their first collectives may go untimed."""
        from torch.distributed import distributed_c10d

        for pg, name in list(distributed_c10d._world.pg_names.items()):
            if name not in self._timed_groups:
                self._timed_groups.add(name)
                pg._enable_collectives_timing()

    def _warn_if_recorder_off(self) -> None:
        size = os.environ.get("TORCH_FR_BUFFER_SIZE") or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE")
        if size is not None and size.strip() == "0" and not self._warned_off:
            self._warned_off = True
            log.warning("rankscope: torch's flight recorder is off (TORCH_FR_BUFFER_SIZE=0): the collectives of "
                        "process groups other than DDP's and monitor.collective()'s are not seen")

    # -- status: sequence numbers ------------------------------------------------
    def _note_status(self, status: dict[str, dict[str, str]]) -> bool:
        """Store each known group's sequence numbers; True when a collective stayed in flight
        since the last read and its op is not known yet."""
        stuck = False
        for pg_id, s in status.items():
            enqueued = int(s.get("last_enqueued_collective", -1))
            completed = int(s.get("last_completed_collective", -1))
            group = self.groups.get(pg_id)
            if group is not None:
                group.enqueued, group.completed = enqueued, completed
            waiting = completed + 1 if completed < enqueued else None
            if waiting is not None and self._suspect.get(pg_id) == waiting \
                    and (group is None or waiting not in group.in_flight):
                stuck = True
            if waiting is None:
                self._suspect.pop(pg_id, None)
            else:
                self._suspect[pg_id] = waiting
        return stuck

    # -- entries: ops, bytes, enqueue times --------------------------------------
    def _read_entries(self) -> None:
        body = self._source.entries_json()
        start = self._first_new_entry(body)
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
            self._count(entry)
            self.entries_read += 1
            at = following
            elapsed = time.perf_counter() - slice_start
            if elapsed >= GIL_SLICE_S:
                self._note_slice(elapsed, time.thread_time() - slice_cpu)
                time.sleep(0)   # let the training thread have the GIL
                slice_start, slice_cpu = time.perf_counter(), time.thread_time()
        self._note_slice(time.perf_counter() - slice_start, time.thread_time() - slice_cpu)

    def _note_slice(self, wall: float, cpu: float) -> None:
        self.longest_slice_s = max(self.longest_slice_s, wall)
        self.longest_slice_cpu_s = max(self.longest_slice_cpu_s, cpu)

    def _first_new_entry(self, body: bytes) -> int:
        """Offset of the first entry not counted yet (entries are in record order), or -1 if none.
        A gap (entries overwritten in the ring before they were read) is counted by ``_count``."""
        begin = body.find(b'"entries":[')
        if begin < 0:
            return -1
        begin += len(b'"entries":[')
        if body[begin:begin + 1] != b"{":
            return -1
        if self._last_record < 0:
            return begin
        first = min(self._pending_duration, default=self._last_record + 1)
        at = body.find(b'"record_id":%d,' % first, begin)
        if at < 0 and self._pending_duration:   # overwritten before their durations came: give up on them
            self._pending_duration.clear()
            at = body.find(b'"record_id":%d,' % (self._last_record + 1), begin)
        if at >= 0:
            return body.rfind(_ENTRY_START, begin, at)
        last = body.rfind(b'"record_id":')
        newest = int(re.match(rb'"record_id":(\d+)', body[last:last + 40]).group(1))
        if newest == self._last_record:
            return -1
        if newest < self._last_record:   # the recorder was reset: its ids start over
            self._last_record = -1
        return begin

    def _count(self, entry: dict) -> None:
        record = int(entry.get("record_id", -1))
        if record <= self._last_record:
            self._late_duration(record, entry)
            return
        if self._last_record >= 0 and record > self._last_record + 1:
            self._drop("flight_recorder", "entries overwritten in the ring before they were read",
                       record - self._last_record - 1)
        self._last_record = record
        pg_id = str(entry.get("pg_id"))
        group = self._group(pg_id, entry.get("process_group") or ("", ""))
        if group is None:
            self._drop("process_group", f"more than {self._max_groups} process groups on this rank")
            return
        op = op_of(entry.get("profiling_name", ""))
        count, nbytes = self._series(group, op)
        count.inc()
        nbytes.inc(entry_nbytes(entry, op))
        duration_ms = entry.get("duration_ms")
        if duration_ms is not None:
            self._m.process_group_duration(group.label, op).observe(float(duration_ms) / 1000.0)
        elif not entry.get("time_discovered_completed_ns") and entry.get("profiling_name", "").startswith("nccl:"):
            # NCCL's watchdog writes the duration (collective timing on) once it sees the work
            # complete: read this entry again until then.
            if len(self._pending_duration) >= MAX_IN_FLIGHT:
                self._pending_duration.pop(min(self._pending_duration))
            self._pending_duration[record] = (group.label, op)
        seq = int(entry.get("collective_seq_id", 0))
        if not entry.get("is_p2p") and seq > group.completed:
            if len(group.in_flight) >= MAX_IN_FLIGHT:   # completions not seen: keep the newest
                del group.in_flight[min(group.in_flight)]
            group.in_flight[seq] = (op, int(entry.get("time_created_ns", 0)) / 1e9)

    def _late_duration(self, record: int, entry: dict) -> None:
        """An entry read before its work completed: its duration, once the backend wrote it."""
        pending = self._pending_duration.get(record)
        if pending is None:
            return
        duration_ms = entry.get("duration_ms")
        if duration_ms is not None:
            self._m.process_group_duration(*pending).observe(float(duration_ms) / 1000.0)
            del self._pending_duration[record]
        elif entry.get("time_discovered_completed_ns"):   # completed without one: timing is off
            del self._pending_duration[record]

    def _group(self, pg_id: str, process_group: Any) -> Group | None:
        group = self.groups.get(pg_id)
        if group is not None or pg_id in self._refused:
            return group
        if len(self.groups) >= self._max_groups:
            self._refused.add(pg_id)
            log.warning("rankscope: more than %d process groups on this rank; collectives of group %s are "
                        "dropped (RANKSCOPE_MAX_PROCESS_GROUPS)", self._max_groups, process_group)
            return None
        name, desc = (list(process_group) + ["", ""])[:2]
        group = Group(pg_id, str(name), group_label(str(name), str(desc)))
        group.seq_children = self._m.process_group_seq(group.label, group.name)
        status = self._status.get(pg_id, {})
        group.enqueued = int(status.get("last_enqueued_collective", -1))
        group.completed = int(status.get("last_completed_collective", -1))
        self.groups[pg_id] = group
        return group

    def _series(self, group: Group, op: str):
        series = group.series.get(op)
        if series is None:
            series = group.series[op] = self._m.process_group_counters(group.label, group.name, op)
        return series

    # -- publish ------------------------------------------------------------------
    def _publish(self) -> None:
        oldest_any = 0.0
        for group in self.groups.values():
            enqueued_child, completed_child = group.seq_children
            if group.enqueued >= 0:
                enqueued_child.set(group.enqueued)
                completed_child.set(group.completed)
            for seq in [s for s in group.in_flight if s <= group.completed]:
                del group.in_flight[seq]
            oldest: dict[str, float] = {}
            for op, started in group.in_flight.values():
                if op not in oldest or started < oldest[op]:
                    oldest[op] = started
                if started and (not oldest_any or started < oldest_any):
                    oldest_any = started
            for op in set(oldest) | set(group.published_in_flight):
                since = oldest.get(op, 0.0)
                if group.published_in_flight.get(op) != since:
                    self._m.process_group_in_flight(group.label, group.name, op).set(since)
                    if since:
                        group.published_in_flight[op] = since
                    else:
                        group.published_in_flight.pop(op, None)
        if oldest_any and self._on_in_flight is not None:
            self._on_in_flight(oldest_any)


def _ring_size() -> int:
    """Entries torch's flight recorder keeps (its own default, 2000, when the variables are unset)."""
    raw = os.environ.get("TORCH_FR_BUFFER_SIZE") or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE") or "2000"
    return int(raw) if raw.strip().isdigit() else 2000


def _dist_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()



class ProcessGroupMetrics:
    """The per-process-group children, bound on first use of a (group, op)."""

    def __init__(self, rank_metrics: Any):
        self._rm = rank_metrics
        self._durations: dict[tuple[str, str], Any] = {}

    def _child(self, name: str, **labels: str):
        return self._rm.child(self._rm.family(name), labels)

    def process_group_counters(self, group: str, group_id: str, op: str):
        return (self._child("rankscope_process_group_collectives_total", group=group, group_id=group_id, op=op),
                self._child("rankscope_process_group_collective_bytes_total", group=group, group_id=group_id, op=op))

    def process_group_seq(self, group: str, group_id: str):
        return (self._child("rankscope_process_group_last_enqueued_seq", group=group, group_id=group_id),
                self._child("rankscope_process_group_last_completed_seq", group=group, group_id=group_id))

    def process_group_in_flight(self, group: str, group_id: str, op: str):
        return self._child("rankscope_process_group_in_flight_started_timestamp_seconds", group=group,
                           group_id=group_id, op=op)

    def process_group_duration(self, group: str, op: str):
        child = self._durations.get((group, op))
        if child is None:
            child = self._durations[(group, op)] = self._child(
                "rankscope_process_group_collective_duration_seconds", group=group, op=op)
        return child
