"""Every collective of every process group, read from torch's flight recorders.

FSDP2, DTensor / tensor parallel, pipeline schedules and user code on
sub-groups issue collectives that no rankscope wrapper sees. torch (>= 2.7)
records every collective of every process group in a flight recorder (a ring
of ``TORCH_FR_BUFFER_SIZE`` entries, 2000 by default since torch 2.11). There
are two: gloo and the other CPU backends record into libtorch_cpu's, and
ProcessGroupNCCL into its own in libtorch_cuda, reached only through the NCCL
entry points (``_dump_nccl_trace_json``, the worker server's
``dump_nccl_trace_json`` handler). Each is read where it exists, with its own
cursor: record ids start at 0 in each. ``ProcessGroupReader`` reads them from a
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

The parts: ``ring_source`` (the reads), ``ring_entries`` (the entries, each counted
once), ``group_table`` (the groups: labels, budget, publishing), ``group_metrics``
(the series on the rank's metrics); this module decides when each read is due.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

from rankscope.collectives.flight_recorder import RING_DEFAULT
from rankscope.collectives.group_table import Group, GroupTable
from rankscope.collectives.protocols import ProcessGroupSink, RingSource
from rankscope.collectives.ring_entries import Cursor, EntryCounter

log = logging.getLogger("rankscope")

ENTRIES_EVERY_S = 1.0        # read new flight-recorder entries at least this far apart (and on a possible hang)
ENTRIES_AT_MOST_EVERY_S = 10.0   # ... and at most this far apart, unless a read costs more than
READ_BUDGET = 100                # 1/READ_BUDGET of that time (a large ring: reads further apart)
RING_SHARE = 0.5             # aim to read when about this share of the ring is new

DEFAULT_PG_ID = "0"   # the default (world) group, in torch's recorders and as its name


class ProcessGroupReader:
    """Reads the flight recorders and writes the per-process-group series (see the module docstring).

    ``metrics`` provides ``process_group_counters(label, group_id, op)`` etc. (ProcessGroupSink:
    rankscope.collectives.group_metrics); ``drop(what, reason, n)`` and ``error()`` count what goes
    wrong. ``source`` has ``recorders`` (names), ``status(recorder)``, ``entries_json(recorder)`` and
    ``close()`` (RingSource: rankscope.collectives.ring_source). The groups and their series are
    ``GroupTable``'s; the entries are counted by ``EntryCounter``."""

    def __init__(self, metrics: ProcessGroupSink, drop: Callable[..., None], error: Callable[[], None],
                 source: RingSource, max_groups: int, interval_s: float, entries_every_s: float = ENTRIES_EVERY_S,
                 initialized: Callable[[], bool] | None = None,
                 on_in_flight: Callable[[float], None] | None = None, timing: bool = False, ring: int = RING_DEFAULT,
                 default_recorder: Callable[[], str] | None = None):
        self._m = metrics
        self._error = error
        self._source = source
        self._interval_s = interval_s
        self._entries_every_s = entries_every_s
        self._initialized = initialized or _dist_initialized
        self._default_recorder = default_recorder or _default_group_recorder
        self._on_in_flight = on_in_flight   # called with the oldest enqueue time in flight (flight-recorder dump)
        self._timing = timing               # turn on each process group's collective timing (NCCL durations)
        self._timed_groups: set[str] = set()
        self.cursors = {name: Cursor(name) for name in source.recorders}
        self._table = GroupTable(metrics, max_groups, tuple(self.cursors))
        self._entries = EntryCounter(self._table, metrics, drop)
        self._ring = ring                        # entries the recorders keep (flight_recorder.ring_size)
        self._warned_off = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rankscope-process-groups", daemon=True)

    @property
    def groups(self) -> dict[tuple[str, str], Group]:
        """(recorder, pg_id) -> Group."""
        return self._table.groups

    @property
    def roles(self) -> dict[str, str]:
        """Group name -> its device-mesh dimension (rankscope.layout.group_roles; see GroupTable)."""
        return self._table.roles

    @roles.setter
    def roles(self, roles: dict[str, str]) -> None:
        self._table.roles = roles

    # What the entries' decoding cost (EntryCounter): the benchmarks' figures.
    @property
    def entries_read(self) -> int:
        return self._entries.entries_read

    @property
    def longest_slice_s(self) -> float:
        return self._entries.longest_slice_s

    @property
    def longest_slice_cpu_s(self) -> float:
        return self._entries.longest_slice_cpu_s

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
                _enable_timing(self._timed_groups)
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
        stuck = self._table.note_status(cursor.recorder, status, cursor.suspect)
        now = time.monotonic()
        enqueued = sum(int(st.get("last_enqueued_collective", -1)) + 1 for st in status.values())
        # A group not known yet has no labels: its sequence numbers wait for its entries.
        unknown = any(not self._table.knows((cursor.recorder, pg_id)) for pg_id in status)
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
        group = self._table.group(cursor.recorder, DEFAULT_PG_ID, (DEFAULT_PG_ID, "default_pg"), cursor.status)
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

    def _read_entries(self, cursor: Cursor) -> None:
        self._entries.count_new(cursor, self._source.entries_json(cursor.recorder))

    def _publish(self) -> None:
        oldest_any = self._table.publish()
        if oldest_any and self._on_in_flight is not None:
            self._on_in_flight(oldest_any)


def _enable_timing(timed_groups: set[str]) -> None:
    """RANKSCOPE_COLLECTIVE_TIMING=1: every process group times its collectives (NCCL: two CUDA
    events each, read by NCCL's watchdog into the recorder's duration_ms). Groups created since
    the last poll (not in ``timed_groups``) get it now; their first collectives may go untimed."""
    from torch.distributed import distributed_c10d

    for pg, name in list(distributed_c10d._world.pg_names.items()):
        if name not in timed_groups:
            timed_groups.add(name)
            pg._enable_collectives_timing()


def _never(recorder: str) -> bool:
    return False


def _dist_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _default_group_recorder() -> str:
    """The recorder that numbers the default group's collectives: NCCL's where its backend has
    NCCL (a "cuda:nccl,cpu:gloo" group too), else the CPU one (gloo)."""
    import torch.distributed as dist

    return "nccl" if "nccl" in str(dist.get_backend()).lower() else "cpu"
