"""Every collective of every process group, read from torch's flight recorder.

FSDP2, DTensor / tensor parallel, pipeline schedules and user code on
sub-groups issue collectives that no rankscope wrapper sees. torch (>= 2.7)
records every collective of every process group in a flight recorder (a ring
of ``TORCH_FR_BUFFER_SIZE`` entries, 2000 by default since torch 2.11). There
are two: gloo and the other CPU backends record into libtorch_cpu's, and
ProcessGroupNCCL into its own in libtorch_cuda, reached only through the NCCL
entry points (``_dump_nccl_trace_json``, the worker server's
``dump_nccl_trace_json`` handler). Each is read where it exists, with its own
cursor: record ids start at 0 in each. This module reads them from a
background thread (``rankscope-process-groups``) and publishes, per process
group:

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
``mesh_<dim>``; one over the whole world reuses the default group, and is named by
its dimension once ``watch()`` saw the mesh: ``roles``), the group's own description where the user gave one, else
``pg<name>``; ``group_id`` is the group's name, which torch makes the same on
every member rank. A group with both a CUDA and a CPU backend
(``"cuda:nccl,cpu:gloo"``) numbers its collectives per backend: its CPU
backend's half is ``group_id="<name>.cpu"``, so that the two sequences are never
compared with each other. At most ``max_groups`` groups per rank are published; the
collectives of any further group are counted as dropped (``process_group``).
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import math
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

from rankscope.collectives.flight_recorder import RING_DEFAULT
from rankscope.collectives.tracker import bus_factor

log = logging.getLogger("rankscope")

GIL_SLICE_S = 0.00025        # decode entries for at most this long before giving the GIL back
ENTRIES_EVERY_S = 1.0        # read new flight-recorder entries at least this far apart (and on a possible hang)
ENTRIES_AT_MOST_EVERY_S = 10.0   # ... and at most this far apart, unless a read costs more than
READ_BUDGET = 100                # 1/READ_BUDGET of that time (a large ring: reads further apart)
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
    """One process group of one recorder. ``enqueued`` and ``completed`` are the published
    sequence numbers of its collectives: the status's, or, once the status is seen counting
    other work too (``counts_p2p``), the entries'."""

    pg_id: str
    name: str
    label: str
    size: int = 0                                      # ranks in the group (0: unknown, no bus bytes)
    series: dict = field(default_factory=dict)         # op -> (count child, bytes child, bus bytes child)
    in_flight: dict = field(default_factory=dict)      # seq -> (op, unix seconds enqueued)
    published_in_flight: dict = field(default_factory=dict)   # op -> start last written
    enqueued: int = -1
    completed: int = -1
    seq_children: tuple = ()
    # The status numbers every op of the group (gloo: send and recv too; NCCL: its p2p work by
    # its own counter), while the entries' collective_seq_id numbers only its collectives: in a
    # pipeline group the stages' status numbers differ by their sends and receives. Once the
    # status is ahead of the entries' newest collective, the entries' numbers are published.
    status_enqueued: int = -1
    collective_enqueued: int = -1     # the newest collective's seq among the entries read
    collective_completed: int = -1    # the newest retired (completed) one's
    counts_p2p: bool = False
    placeholder: bool = False         # the default group at 0, before the rank's first collective


# The flight recorders torch has, by name: (the status call of its C++ bindings, the worker
# server's handler for its whole ring as JSON). "cpu" records gloo and the other CPU backends,
# "nccl" ProcessGroupNCCL (CUDA builds only).
RECORDERS = {
    "cpu": ("_dump_fr_trace_json", "/handler/fr_trace_json"),
    "nccl": ("_dump_nccl_trace_json", "/handler/dump_nccl_trace_json?includecollectives=true&onlyactive=false"),
}


def available_recorders(c10d: Any = None) -> tuple[str, ...]:
    """The recorders this torch build has. Where torch records every backend into the generic
    recorder too (``FlightRecorderHook``, after 2.13), that one alone: reading both would count
    each NCCL collective twice."""
    if c10d is None:
        import torch

        c10d = getattr(torch._C, "_distributed_c10d", None)
    if c10d is not None and hasattr(c10d, "FlightRecorderHook"):
        return ("cpu",) if hasattr(c10d, RECORDERS["cpu"][0]) else ()
    return tuple(name for name, (status, _) in RECORDERS.items() if c10d is not None and hasattr(c10d, status))


def recorder_holds_cuda_events(recorder: str, c10d: Any) -> bool:
    """Whether reading ``recorder`` queries CUDA events (NCCL's collectives): such a read must run
    with the rank's device current (rankscope.device.cuda)."""
    return recorder == "nccl" or hasattr(c10d, "FlightRecorderHook")


_FETCH_CHUNK = 256 * 1024   # bytes of the ring's JSON received per GIL release


class FlightRecorderSource:
    """The two reads of each of torch's flight recorders; replaceable in tests.

    NCCL's recorder queries the CUDA events of its unfinished collectives when read, on the
    calling thread: with no device current there, that makes a CUDA context on GPU 0. So it
    is read only once the rank's device is known, inside its guard, and its ring is serialised
    by torch's worker server (a thread of torch's, whose current device is 0) only where the
    rank's device *is* 0 (one GPU per rank through CUDA_VISIBLE_DEVICES, or local rank 0);
    elsewhere on this thread, holding the GIL while torch serialises it (docs/collectives.md)."""

    def __init__(self, socket_dir: Path, rank: int, recorders: tuple[str, ...] | None = None,
                 device: Any = None, c10d: Any = None):
        self._socket_dir = socket_dir
        self._rank = rank
        self._device = device                 # rankscope.device.RankDevice, or None (no CUDA here)
        self._c10d = c10d                     # torch._C._distributed_c10d (a test's double)
        self.recorders = available_recorders(c10d) if recorders is None else recorders
        self._server: Any = None
        self._path = ""

    @property
    def c10d(self) -> Any:
        if self._c10d is None:
            import torch

            self._c10d = torch._C._distributed_c10d
        return self._c10d

    def _on_device(self, recorder: str) -> bool | None:
        """None: the recorder cannot be read yet (CUDA events, no device known); else whether its
        reads need the device's guard."""
        if not recorder_holds_cuda_events(recorder, self.c10d):
            return False
        device = self._device
        return True if device is not None and device.cuda else None

    def status(self, recorder: str = "cpu") -> dict[str, dict[str, str]]:
        call = getattr(self.c10d, RECORDERS[recorder][0])
        guarded = self._on_device(recorder)
        if guarded is None:
            return {}
        raw = self._device.api.call_on(self._device.index, call, False, False) if guarded else call(False, False)
        return json.loads(raw).get("pg_status", {})

    def holds_gil(self, recorder: str) -> bool:
        """Whether reading ``recorder``'s entries holds the GIL throughout (serialised on the calling
        thread rather than by the worker server)."""
        return bool(self._on_device(recorder)) and self._device.index != 0

    def entries_json(self, recorder: str = "cpu") -> bytes | bytearray:
        """The whole ring as JSON, serialised by torch's C++ worker server (no GIL held meanwhile),
        or by the recorder's own call on this thread where the server's thread would touch
        another device than the rank's (see the class docstring).

        Read in chunks into one buffer allocated up front: a full 20,000-entry ring (torchtitan's
        size) is ~15 MB, and reading it whole builds the bytes object under the GIL (a 6.5 ms
        stop for the training thread); each chunk's receive lets the GIL go."""
        guarded = self._on_device(recorder)
        if guarded is None:
            return b""
        if guarded and self._device.index != 0:
            call = getattr(self.c10d, RECORDERS[recorder][0])
            return self._device.api.call_on(self._device.index, call, True, False)
        if self._server is None:
            self._start()
        conn = _UnixHTTPConnection(self._path)
        try:
            conn.request("POST", RECORDERS[recorder][1])
            resp = conn.getresponse()
            if resp.status != 200:
                raise OSError(f"flight recorder server answered {resp.status}")
            length = resp.length
            if length is None:   # no Content-Length: read to the end
                return bytearray(resp.read())
            body = bytearray(length)   # calloc: pages are zeroed by the kernel as they are touched
            view, got = memoryview(body), 0
            while got < length:
                n = resp.readinto(view[got:got + _FETCH_CHUNK])
                if not n:
                    raise OSError(f"flight recorder server closed after {got} of {length} bytes")
                got += n
            view.release()
            return body
        finally:
            conn.close()

    def _start(self) -> None:
        _WorkerServer = self.c10d._WorkerServer
        path = self._socket_dir / f"fr-{self._rank}-{os.getpid()}.sock"
        if len(str(path)) > 100:   # sun_path holds 108 bytes
            path = Path(tempfile.mkdtemp(prefix="rankscope-fr-")) / "fr.sock"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        with _c10_warnings_quiet():
            self._server = _WorkerServer(str(path))
        os.chmod(path, 0o600)   # the server also answers stack dumps: this user only
        self._path = str(path)

    def close(self) -> None:
        if self._server is not None:
            try:
                with _c10_warnings_quiet():
                    self._server.shutdown()
            finally:
                self._server = None
                Path(self._path).unlink(missing_ok=True)


@contextlib.contextmanager
def _c10_warnings_quiet():
    """torch's worker server announces its start and stop as warnings on every rank ("Server
    listening to UNIX ...", "shutting down", "exited"): nothing the user asked for. c10's log
    level is raised to errors for just those two calls (a c10 warning another thread logs in
    that millisecond is lost with them); where the level cannot be reached, nothing changes."""
    level = _c10_log_level()
    if level is None:
        yield
        return
    before = level.value
    level.value = max(before, C10_LOG_ERROR)
    try:
        yield
    finally:
        level.value = before


C10_LOG_ERROR = 2   # c10's severities: 0 info, 1 warning, 2 error, 3 fatal


@functools.cache
def _c10_log_level() -> Any:
    """libc10's minimum log level (FLAGS_caffe2_log_level, which TORCH_CPP_LOG_LEVEL sets at import)."""
    try:
        import ctypes

        import torch

        library = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so"))
        return ctypes.c_int.in_dll(library, "FLAGS_caffe2_log_level")
    except (OSError, ValueError):
        return None


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str):
        super().__init__("localhost", timeout=5.0)
        self._unix_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._unix_path)


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


DEFAULT_PG_ID = "0"   # the default (world) group, in torch's recorders and as its name


class ProcessGroupReader:
    """Reads the flight recorders and writes the per-process-group series (see the module docstring).

    ``metrics`` provides ``process_group_series(label, group_id, op)`` etc. (rankscope.publishing.metrics);
    ``drop(what, reason, n)`` and ``error()`` count what goes wrong. ``source`` has
    ``recorders`` (names), ``status(recorder)``, ``entries_json(recorder)`` and ``close()``."""

    def __init__(self, metrics: Any, drop: Callable[..., None], error: Callable[[], None], source: Any,
                 max_groups: int, interval_s: float, entries_every_s: float = ENTRIES_EVERY_S,
                 initialized: Callable[[], bool] | None = None,
                 on_in_flight: Callable[[float], None] | None = None, timing: bool = False, ring: int = RING_DEFAULT,
                 default_recorder: Callable[[], str] | None = None):
        self._m = metrics
        self._drop = drop
        self._error = error
        self._source = source
        self._max_groups = max_groups
        self._interval_s = interval_s
        self._entries_every_s = entries_every_s
        self._initialized = initialized or _dist_initialized
        self._default_recorder = default_recorder or _default_group_recorder
        self._on_in_flight = on_in_flight   # called with the oldest enqueue time in flight (flight-recorder dump)
        self._timing = timing               # turn on each process group's collective timing (NCCL durations)
        self._timed_groups: set[str] = set()
        self.cursors = {name: Cursor(name) for name in source.recorders}
        self.groups: dict[tuple[str, str], Group] = {}   # (recorder, pg_id) -> Group
        # Group name -> its device-mesh dimension, where the monitor learnt the job's mesh
        # (rankscope.layout.group_roles): a dimension over the whole world reuses the default group.
        self.roles: dict[str, str] = {}
        self._refused: set[tuple[str, str]] = set()      # groups over the budget
        self._ring = ring                        # entries the recorders keep (flight_recorder.ring_size)
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
            # torch's recorders outlive the process groups: the final read (close(), or the
            # exit hook) still counts the last collectives of a job that destroyed its groups first.
            initialized = self._initialized()
            if not initialized and not final:
                return
            if self._timing and initialized:
                self._enable_timing()
            seen = False
            for cursor in self.cursors.values():
                try:
                    seen |= self._poll_recorder(cursor, final)
                except Exception:
                    self._error()
            if not seen:
                self._warn_if_recorder_off()
            self._publish()
        except Exception:
            self._error()
        finally:
            self._lock.release()

    def _poll_recorder(self, cursor: Cursor, final: bool) -> bool:
        """The recorder's status, then its new entries when due; whether it knows any group."""
        status = cursor.status = self._source.status(cursor.recorder)
        stuck = self._note_status(cursor, status)
        now = time.monotonic()
        enqueued = sum(int(st.get("last_enqueued_collective", -1)) + 1 for st in status.values())
        # A group not known yet has no labels: its sequence numbers wait for its entries.
        unknown = any((cursor.recorder, pg_id) not in self.groups and (cursor.recorder, pg_id) not in self._refused
                      for pg_id in status)
        holds_gil = getattr(self._source, "holds_gil", _never)(cursor.recorder)
        if not status and not final:
            self._before_first_collective(cursor)
            return False   # no group yet (or a recorder that cannot be read yet): nothing in its ring
        if final or stuck or self._read_due(cursor, now, enqueued - cursor.enqueued_at_read, unknown, holds_gil):
            cursor.last_entries, cursor.enqueued_at_read = now, enqueued
            try:   # without entries the sequence numbers are still published
                self._read_entries(cursor)
            except Exception:
                self._error()
            cursor.read_s = time.monotonic() - now
        return bool(status)

    def _before_first_collective(self, cursor: Cursor) -> None:
        """Before its first collective a rank's recorder knows no group, and a rank stuck there (a
        first compile, a checkpoint load, its own start-up code) would have no sequence number to
        be behind its waiting peers by. The default group, which every rank is in, is published
        at 0 (none enqueued: the status counts from 1) until the status names it; only on the
        recorder of the default group's backend, so as never to stand beside its real numbers."""
        if (cursor.recorder, DEFAULT_PG_ID) in self.groups or not self._initialized():
            return
        try:
            if self._default_recorder() != cursor.recorder:
                return
        except Exception:   # no default group after all (destroyed meanwhile)
            return
        group = self._group(cursor, DEFAULT_PG_ID, (DEFAULT_PG_ID, "default_pg"))
        if group is not None:
            group.enqueued = group.completed = group.status_enqueued = 0
            group.placeholder = True

    def _read_due(self, cursor: Cursor, now: float, new_collectives: int, unknown_group: bool = False,
                  holds_gil: bool = False) -> bool:
        """Serialising the ring costs the same however few entries are new (about 10 us an entry,
        on torch's thread): read once about half of it is new, as the groups' sequence numbers
        count, but no closer than entries_every_s and no further than ENTRIES_AT_MOST_EVERY_S apart.
        A busy FSDP job is read every second or few; a DDP job with a few collectives a second
        every ten.

        ``holds_gil``: this recorder's ring is serialised on this thread, holding the GIL the
        training thread needs (NCCL's, where the rank's GPU is not 0: FlightRecorderSource).
        Then only the budget makes a read due (a possible hang still reads at once): collectives
        beyond half a ring between two reads are counted as dropped, never bought with the
        training thread's time."""
        since = now - cursor.last_entries
        if since < self._entries_every_s:
            return False
        # Unforced, a read waits long enough to cost at most 1/READ_BUDGET of the time between reads:
        # a full 20,000-entry ring (torchtitan's) takes ~0.7 s to serialise and decode, and read
        # every 10 s it would cost a slow job 7% of a core. Half a ring new is always read (the
        # ring would overwrite entries not yet counted), unless the read would hold the GIL.
        stale_after = max(ENTRIES_AT_MOST_EVERY_S, READ_BUDGET * cursor.read_s)
        if holds_gil:
            return since >= stale_after
        return (since >= stale_after or self._ring <= 0 or unknown_group
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
        if self._ring == 0 and not self._warned_off:
            self._warned_off = True
            flag = next((f"{name}={os.environ[name]}" for name in ("TORCH_FR_BUFFER_SIZE",
                                                                   "TORCH_NCCL_TRACE_BUFFER_SIZE")
                         if os.environ.get(name)), "TORCH_FR_BUFFER_SIZE=0")
            log.warning("rankscope: torch's flight recorder is off (%s; torchtitan sets it from "
                        "--comm.trace_buf_size): the collectives of FSDP, tensor-parallel, pipeline and every process group other than DDP's "
                        "and monitor.collective()'s are not counted, and a hang in them is not located. Set it to "
                        "2000 or more (torch's default 2000, torchtitan's 20000) to see them", flag)

    # -- status: sequence numbers ------------------------------------------------
    def _note_status(self, cursor: Cursor, status: dict[str, dict[str, str]]) -> bool:
        """Store each known group's sequence numbers; True when a collective stayed in flight
        since the last read and its op is not known yet."""
        stuck = False
        for pg_id, s in status.items():
            enqueued = int(s.get("last_enqueued_collective", -1))
            completed = int(s.get("last_completed_collective", -1))
            group = self.groups.get((cursor.recorder, pg_id))
            if group is not None:
                group.status_enqueued = enqueued
                if not group.counts_p2p:
                    group.enqueued, group.completed = enqueued, completed
            waiting = completed + 1 if completed < enqueued else None
            if waiting is not None and cursor.suspect.get(pg_id) == waiting \
                    and (group is None or waiting not in group.in_flight):
                stuck = True
            if waiting is None:
                cursor.suspect.pop(pg_id, None)
            else:
                cursor.suspect[pg_id] = waiting
        return stuck

    # -- entries: ops, bytes, enqueue times --------------------------------------
    def _read_entries(self, cursor: Cursor) -> None:
        body = self._source.entries_json(cursor.recorder)
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
        self._use_collective_numbers(cursor)

    def _use_collective_numbers(self, cursor: Cursor) -> None:
        """After a read of the entries: a group whose status is ahead of its newest collective
        counts its sends and receives too (collectives enqueued after the status read can only
        put the entries ahead); from then on its entries' numbers are published."""
        for (recorder, _), group in self.groups.items():
            if recorder != cursor.recorder:
                continue
            if not group.counts_p2p and group.collective_enqueued >= 0 \
                    and group.status_enqueued > group.collective_enqueued:
                group.counts_p2p = True
            if group.counts_p2p:
                group.enqueued, group.completed = group.collective_enqueued, group.collective_completed

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
        group = self._group(cursor, pg_id, entry.get("process_group") or ("", ""))
        if group is None:
            self._drop("process_group", f"more than {self._max_groups} process groups on this rank")
            return
        op = op_of(entry.get("profiling_name", ""))
        count, nbytes, bus_nbytes = self._series(group, op)
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
        # watchdog period after completion); pruned by that number as it moves (_publish).
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
            group = self.groups.get((cursor.recorder, unretired[0]))
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

    def _group(self, cursor: Cursor, pg_id: str, process_group: Any) -> Group | None:
        key = (cursor.recorder, pg_id)
        group = self.groups.get(key)
        if group is not None and not group.placeholder or key in self._refused:
            return group
        if group is not None:   # the placeholder meets the group's first entries: the group proper
            del self.groups[key]
            if self._label(process_group) == group.label:
                group.placeholder = False
                self.groups[key] = group
                return group
            # Named by its mesh dimension since (watch()): the placeholder's series are retired
            # (NaN: no comparison holds), the group's own are bound under its name.
            for child in group.seq_children:
                child.set(math.nan)
        if len(self.groups) >= self._max_groups:
            self._refused.add(key)
            log.warning("rankscope: more than %d process groups on this rank; collectives of group %s are "
                        "dropped (RANKSCOPE_MAX_PROCESS_GROUPS)", self._max_groups, process_group)
            return None
        group_id = str(list(process_group)[0])
        if cursor.recorder == "cpu" and "nccl" in self.cursors and _has_cuda_backend(group_id):
            group_id += ".cpu"   # the CPU half of a "cuda:nccl,cpu:gloo" group: its own sequence
        group = Group(pg_id, group_id, self._label(process_group), size=_group_size(str(list(process_group)[0])))
        group.seq_children = self._m.process_group_seq(group.label, group.name)
        status = cursor.status.get(pg_id, {})
        group.enqueued = group.status_enqueued = int(status.get("last_enqueued_collective", -1))
        group.completed = int(status.get("last_completed_collective", -1))
        self.groups[key] = group
        return group

    def _label(self, process_group: Any) -> str:
        """The group's label: its mesh dimension where watch() learnt it, else its role."""
        name, desc = (str(part) for part in (list(process_group) + ["", ""])[:2])
        label = self.roles.get(name) or group_label(name, desc)
        return re.sub(r"[^a-z0-9_]", "_", label.lower())[:MAX_LABEL]

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


def _never(recorder: str) -> bool:
    return False


def _has_cuda_backend(group_name: str) -> bool:
    """Whether the process group called ``group_name`` also has a CUDA backend."""
    from torch.distributed import distributed_c10d

    for pg, name in list(distributed_c10d._world.pg_names.items()):
        if name == group_name:
            return any(getattr(t, "type", t) == "cuda" for t in getattr(pg, "_device_types", ()))
    return False


def _group_size(group_name: str) -> int:
    """The size of the process group called ``group_name`` (0 if this process has none by that name)."""
    from torch.distributed import distributed_c10d

    for pg, name in list(distributed_c10d._world.pg_names.items()):
        if name == group_name:
            try:
                return int(pg.size())
            except Exception:   # a group being destroyed: its bus bytes are not counted
                return 0
    return 0


def _dist_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _default_group_recorder() -> str:
    """The recorder that numbers the default group's collectives: NCCL's where its backend has
    NCCL (a "cuda:nccl,cpu:gloo" group too), else the CPU one (gloo)."""
    import torch.distributed as dist

    return "nccl" if "nccl" in str(dist.get_backend()).lower() else "cpu"



class ProcessGroupMetrics:
    """The per-process-group children, bound on first use of a (group, op)."""

    def __init__(self, rank_metrics: Any):
        self._rm = rank_metrics
        self._durations: dict[tuple[str, str], Any] = {}

    def _child(self, name: str, **labels: str):
        return self._rm.child(self._rm.family(name), labels)

    def process_group_counters(self, group: str, group_id: str, op: str):
        return (self._child("rankscope_process_group_collectives_total", group=group, group_id=group_id, op=op),
                self._child("rankscope_process_group_collective_bytes_total", group=group, group_id=group_id, op=op),
                self._child("rankscope_process_group_collective_bus_bytes_total", group=group, group_id=group_id,
                            op=op))

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
