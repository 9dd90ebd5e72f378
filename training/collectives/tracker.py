"""Collective timing and in-flight tracking.

Two clocks, chosen per tensor:

* CPU tensors (gloo): wall clock from launch to completion. The completion
  callback runs when gloo finishes the work.
* CUDA tensors (NCCL): an NCCL future completes when the work is *enqueued*,
  so wall clock measures nothing. A start event is recorded on the rank
  device's current stream before launch and an end event inside the completion
  callback, whose current stream (of that device) torch synchronises with the
  collective's kernels (rankscope.device.rank_device: never another device's stream). The pair
  is read later with ``event.query()`` (by the background publisher), never
  with ``synchronize()``; until then the collective counts as in flight.

The hot path only appends to bounded structures; the publisher drains them
into the metrics. What a DDP bucket duration means: time from the bucket's
launch to its completion while the rest of backward still runs ("completion
under overlap"); the part of it that backward had to wait for after its own
compute was done is reported separately as the ``comm_wait`` phase.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable

from rankscope.contract.catalog import COLLECTIVE_OPS
from rankscope.device.rank_device import RankDevice

MAX_PENDING = 4096  # completed-but-unpublished records kept before dropping


@dataclass(slots=True)
class CollectiveRecord:
    op: str
    nbytes: int
    start: float        # unix seconds at launch (host)
    duration: float     # seconds
    bucket: int = -1    # DDP bucket index, -1 for explicit collectives
    group_size: int = 1   # ranks in the collective's process group (its bus bytes: bus_nbytes)


class _DeviceSpan:
    """A CUDA event pair still waiting to be read."""

    __slots__ = ("token", "op", "nbytes", "start_unix", "bucket", "group_size", "start_event", "end_event",
                 "duration")

    def __init__(self, token, op, nbytes, start_unix, bucket, group_size, start_event, end_event):
        self.token = token
        self.op = op
        self.nbytes = nbytes
        self.start_unix = start_unix
        self.bucket = bucket
        self.group_size = group_size
        self.start_event = start_event
        self.end_event = end_event
        self.duration: float | None = None   # seconds, once read


class CollectiveTracker:
    """Knows which collectives are in flight and buffers completed ones.

    Written by the training thread and by completion callbacks (gloo's
    thread); read by the publisher. Python's dict and deque operations used
    here are atomic under the GIL, so no lock is taken on the hot path.
    """

    def __init__(self, device: RankDevice):
        self.device = device   # its events are None until the rank's CUDA device is known
        self._tokens = itertools.count()
        self._in_flight: dict[int, tuple[str, float]] = {}   # token -> (op, unix start)
        self.completed: deque[CollectiveRecord] = deque(maxlen=MAX_PENDING)
        self.recent: deque[CollectiveRecord] = deque(maxlen=256)   # for traces of the current step
        self.dropped = 0
        self._device: deque[_DeviceSpan] = deque()
        self._drain_lock = threading.Lock()

    # -- host (wall clock) ------------------------------------------------
    def begin(self, op: str) -> tuple[int, float, float]:
        t0 = time.perf_counter()
        start = time.time()
        return self.mark(op, start), t0, start

    def mark(self, op: str, start: float) -> int:
        """Count ``op`` as in flight since ``start`` (unix seconds), without timing it."""
        token = next(self._tokens)
        self._in_flight[token] = (op, start)
        return token

    def unmark(self, token: int) -> None:
        self._in_flight.pop(token, None)

    def end(self, token: int, op: str, nbytes: int, t0: float, start: float, bucket: int = -1,
            group_size: int = 1) -> None:
        t1 = time.perf_counter()
        self._in_flight.pop(token, None)
        self._record(CollectiveRecord(op, nbytes, start, t1 - t0, bucket, group_size))

    # -- device (CUDA events) ---------------------------------------------
    def begin_device(self, op: str, nbytes: int, bucket: int = -1, group_size: int = 1) -> _DeviceSpan:
        device = self.device
        token = next(self._tokens)
        start = time.time()
        self._in_flight[token] = (op, start)
        try:
            start_event = device.events.get()
            start_event.record(device.stream())
        except Exception:
            self._in_flight.pop(token, None)
            raise
        return _DeviceSpan(token, op, nbytes, start, bucket, group_size, start_event, None)

    def end_device(self, span: _DeviceSpan) -> None:
        """Call where the device's current stream is synchronised with the collective's completion
        (a comm hook's completion callback; after a blocking collective, the caller's stream)."""
        device = self.device
        try:
            span.end_event = device.events.get()
            span.end_event.record(device.stream())
        except Exception:
            self.abandon(span)
            raise
        self._device.append(span)

    def abandon(self, span: _DeviceSpan) -> None:
        """A span whose end could not be recorded: no longer in flight (a hang would be paged
        otherwise), and known to have no duration (a step waiting for its bucket goes on)."""
        self._in_flight.pop(span.token, None)
        span.duration = 0.0

    def poll_device(self) -> int:
        """Read finished event pairs, in launch order; never blocks. Returns how many.
        Off the training thread, inside ``RankDevice.on_device()``."""
        done = 0
        with self._drain_lock:
            while self._device and self._device[0].end_event.query():
                span = self._device.popleft()
                span.duration = span.start_event.elapsed_time(span.end_event) / 1000.0
                self._in_flight.pop(span.token, None)
                self._record(CollectiveRecord(span.op, span.nbytes, span.start_unix, span.duration, span.bucket,
                                              span.group_size))
                self.device.events.put(span.start_event)
                self.device.events.put(span.end_event)
                done += 1
        return done

    # -- shared -----------------------------------------------------------
    def record(self, record: CollectiveRecord) -> None:
        """A collective timed elsewhere (see comm_timing.ReducerTimers)."""
        self._record(record)

    def _record(self, record: CollectiveRecord) -> None:
        if len(self.completed) == self.completed.maxlen:
            self.dropped += 1
        self.completed.append(record)
        self.recent.append(record)

    def drain(self) -> list[CollectiveRecord]:
        out = []
        completed = self.completed
        while completed:
            try:
                out.append(completed.popleft())
            except IndexError:
                break
        return out

    def recent_between(self, start: float, end: float) -> list[CollectiveRecord]:
        """Completed collectives that started within [``start``, ``end``] (unix seconds): a step's
        own, even when read after later steps have run."""
        return [r for r in list(self.recent) if start <= r.start <= end]

    def in_flight(self) -> dict[str, float]:
        """op -> unix start of its oldest collective still in flight."""
        oldest: dict[str, float] = {}
        for op, start in list(self._in_flight.values()):
            if op not in oldest or start < oldest[op]:
                oldest[op] = start
        return oldest


def tensor_nbytes(tensors: Iterable[Any]) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, (list, tuple)):
            total += tensor_nbytes(t)
        elif hasattr(t, "element_size"):
            total += t.numel() * t.element_size()
    return total


def group_size(group: Any = None) -> int:
    """The size of ``group`` (a ``torch.distributed`` process group; None: the world)."""
    if group is not None:
        size = getattr(group, "size", None)
        if not callable(size):
            raise TypeError(f"group must be a torch.distributed process group, got {type(group).__name__}")
        return int(size())
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def bus_factor(op: str, group_size: int) -> float:
    """nccl-tests' bus bandwidth factor: bus bandwidth = algorithm bandwidth (message bytes over
    the collective's duration) times this, so that every op reads against the link's own speed
    (a ring all_reduce moves each byte 2(n-1)/n times; all_gather, reduce_scatter, all_to_all,
    gather and scatter (n-1)/n; broadcast, reduce and point-to-point once)."""
    n = group_size
    if op in ("broadcast", "reduce", "send", "recv"):
        return 1.0
    if op == "barrier" or n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    return (n - 1) / n   # all_gather, reduce_scatter, all_to_all, gather, scatter


def check_op(op: str) -> None:
    if op not in COLLECTIVE_OPS:
        raise ValueError(f"collective op {op!r} is not one of {', '.join(COLLECTIVE_OPS)}")
