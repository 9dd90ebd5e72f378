"""The publisher thread: beats the heartbeat and writes what the rank collected to its metric files.

Every ``interval_s`` (or at once when the training thread asks: an
out-of-memory error), one publish runs one visible sequence:

1. **take**: resolve what the CUDA device has finished (collective timings,
   values, phase events: ``rankscope.device.reads``), then hand the accounting,
   in one call, the steps that ended (``StepHandoff.entries``), those device
   reads, the steps counted without details and the OOM count
   (``StepAccounting.take``, in GIL-releasing slices): it returns their totals;
2. **write** those totals, goodput, health, collectives, memory, drops and
   ``rank_info`` to the mmap files the node exporter reads.

One publish at a time: ``publish`` holds a lock, so a publish from another
thread (the last one in ``stop``) never runs inside the thread's own publish;
it waits for it only a bounded time. Each part is isolated: a failure is
counted under its component and the others still publish.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from typing import Any, Protocol

from rankscope.collectives.flight_recorder import FlightRecorder
from rankscope.collectives.tracker import CollectiveTracker, bus_factor
from rankscope.device.memory import MemorySampler
from rankscope.device.rank_device import RankDevice
from rankscope.errors import TelemetryErrors
from rankscope.flops import FlopsConfig
from rankscope.holds import LongestHold
from rankscope.publishing.metrics import RankMetrics
from rankscope.publishing.stacks import StackDumps
from rankscope.publishing.startup import RankInfo
from rankscope.publishing.startup_phases import StartupPhases
from rankscope.step.accounting import GIL_YIELD_S, Accumulator, StepAccounting
from rankscope.step.handoff import StepHandoff
from rankscope.step.records import DevicePhasesRead, DeviceValueRead
from rankscope.step.watched import Watched


class SpanCounts(Protocol):
    """What the publisher reads of the tracer (``rankscope.tracing.api.Tracing``)."""

    def dropped(self) -> int: ...


class Publisher:
    def __init__(self, metrics: RankMetrics, handoff: StepHandoff, accounting: StepAccounting, watched: Watched,
                 tracker: CollectiveTracker, device: RankDevice, memory: MemorySampler, tracing: SpanCounts,
                 errors: TelemetryErrors, flight_recorder: FlightRecorder, rank_info: RankInfo, stacks: StackDumps,
                 flops: FlopsConfig, interval_s: float, memory_every_s: float, startup: StartupPhases | None = None):
        self._m = metrics
        self._handoff = handoff
        self._accounting = accounting
        self._watched = watched            # the replica check, once watch() found replicas
        self._tracker = tracker
        self._device = device              # its reads, once the rank's CUDA device is known
        self._memory = memory
        self._tracing = tracing
        self._errors = errors
        self._flight_recorder = flight_recorder
        self._rank_info = rank_info
        self._stacks = stacks
        self._flops = flops                # model FLOPs of the steps
        self._startup = startup            # the rank's start-up phase, until its first step
        self._interval_s = interval_s
        self._memory_every_s = memory_every_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rankscope-publisher", daemon=True)
        self._last_memory = 0.0
        self._device_described = False    # the CUDA device's memory and peak FLOP/s are written
        self._alloc_retries = 0.0
        self._in_flight_published: dict[str, float] = {}
        self._published = {"spans": 0, "collective": 0}
        self._acc = Accumulator()          # what the steps since the last publish added up to
        self.hold = LongestHold()          # the longest publish part, after the accounting's sliced take

    def start(self) -> None:
        self.publish()   # heartbeat and zeros visible before the first step
        self._thread.start()

    def _run(self) -> None:
        requests = self._handoff.publish_now
        while not self._stop.is_set():
            asked = requests.wait(self._interval_s)
            if self._stop.is_set():
                return
            self.publish()
            requests.served(asked)

    def flush(self, timeout_s: float = 1.0) -> None:
        """Publish now, from any thread; gives up after ``timeout_s`` if a publish is stuck."""
        self.publish(timeout_s)

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the thread and publish what is left (bounded)."""
        self._stop.set()
        self._handoff.publish_now.wake()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout_s)
        self.publish(timeout_s)

    def publish(self, timeout_s: float = -1) -> None:
        if not self._lock.acquire(timeout=timeout_s):
            return
        try:
            self._acc = Accumulator()   # if taking the steps fails, the parts publish nothing twice
            for component, part in (("publisher", self._take), ("publisher", self._write_steps),
                                    ("publisher", self._write_startup), ("publisher", self._write_time_use),
                                    ("collectives", self._write_collectives), ("memory", self._write_memory),
                                    ("replicas", self._write_replicas),
                                    ("tracing", self._write_drops), ("publisher", self._rank_info.save_when_known),
                                    ("publisher", self._rank_info.publish_saved), ("publisher", self._stacks.check)):
                self.hold.start()
                try:
                    part()
                except Exception:
                    self._errors.error(component)
                self.hold.stop()
                time.sleep(GIL_YIELD_S)   # each part in its own GIL stretch (rankscope.holds)
        finally:
            self._lock.release()

    # -- 1. take ------------------------------------------------------------------------
    def _take(self) -> None:
        """What the CUDA device has finished (collective timings first: device steps need their
        buckets' durations), then everything since the last publish, worked out in one call."""
        reads = self._device.reads
        device: list[DeviceValueRead | DevicePhasesRead] = []
        if reads is not None:
            with self._device.on_device():   # this thread's CUDA calls on the rank's device only
                self._tracker.poll_device()
                device.extend(map(DeviceValueRead._make, reads.ready_values()))
                device.extend(map(DevicePhasesRead, reads.ready_steps()))
                reads.deliver_user_values()
                reads.deliver_arrays()
        handoff = self._handoff
        self.hold.stop()   # the accounting measures its own slices (StepAccounting.hold)
        try:
            self._acc = self._accounting.take(handoff.entries, device, handoff.take_overflow(), handoff.ooms)
        finally:
            self.hold.start()

    # -- 2. write (each part writes a few dozen values at most: well under a millisecond) ----
    def _write_steps(self) -> None:
        m, acc = self._m, self._acc
        m.heartbeat.set(time.time())
        if acc.steps:
            m.steps.inc(acc.steps)
            observe_all(m.step_duration, acc.durations)
            if acc.samples:
                m.samples.inc(acc.samples)
            if acc.tokens:
                m.tokens.inc(acc.tokens)
            if m.model_flops is not None:
                m.model_flops.inc(self._flops.step_flops(acc.samples, acc.tokens) or 0.0)
        observe_all(m.data_wait, acc.data_waits)

    def _write_replicas(self) -> None:
        check = self._watched.replica_check
        if check is not None:
            check.publish()

    def _write_startup(self) -> None:
        if self._startup is not None:
            self._startup.write(self._m, self._handoff.steps_seen)

    def _write_time_use(self) -> None:
        m, acc = self._m, self._acc
        for k, v in acc.wall.items():
            if v > 0:
                m.wall[k].inc(v)
        for k, v in acc.phase.items():  # CUDA steps' phases arrive after their step
            if v:
                m.phase[k].inc(v)
        if acc.ooms:
            m.ooms.inc(acc.ooms)
        for n, child in ((acc.nonfinite_loss, m.nonfinite["loss"]), (acc.nonfinite_grad, m.nonfinite["grad"]),
                         (acc.loss_spikes, m.loss_spikes), (acc.grad_spikes, m.grad_spikes)):
            if n:
                child.inc(n)
        write_step_values(m, acc)

    def _write_collectives(self) -> None:
        m, tracker = self._m, self._tracker
        last: dict[str, float] = {}
        nbytes: dict[str, int] = {}
        bus_nbytes: dict[str, float] = {}
        for rec in tracker.drain():
            m.collective(rec.op).duration.observe(rec.duration)
            last[rec.op] = rec.duration
            nbytes[rec.op] = nbytes.get(rec.op, 0) + rec.nbytes
            bus_nbytes[rec.op] = bus_nbytes.get(rec.op, 0.0) + rec.nbytes * bus_factor(rec.op, rec.group_size)
        for op, v in last.items():
            m.collective(op).last.set(v)
        for op, n in nbytes.items():
            series = m.collective(op)
            series.bytes.inc(n)
            series.bus_bytes.inc(bus_nbytes[op])
        in_flight = tracker.in_flight()
        if in_flight:
            with self._device.on_device():   # NCCL's recorder queries its collectives' CUDA events
                self._flight_recorder.check(min(in_flight.values()))
        for op in set(in_flight) | set(self._in_flight_published):
            since = in_flight.get(op, 0.0)
            if self._in_flight_published.get(op) != since:
                series = m.collective(op)
                series.in_flight.set(1.0 if since else 0.0)
                series.started.set(since)
                if since:
                    self._in_flight_published[op] = since
                else:
                    self._in_flight_published.pop(op, None)

    def _write_memory(self) -> None:
        if time.monotonic() - self._last_memory < self._memory_every_s:
            return
        self._last_memory = time.monotonic()
        m = self._m
        r = self._memory.read()
        m.rss.set(r.rss)
        if self._memory.cuda:
            if not self._device_described:   # the device may become known after start-up (rankscope.device.rank_device)
                self._device_described = True
                m.mem_total.set(self._memory.total())
                m.bind_peak_flops(self._flops.peak(self._device.name, "cuda", self._device.sm_count))
            m.mem_allocated.set(r.allocated)
            m.mem_reserved.set(r.reserved)
            m.mem_peak.set(r.peak)
            if r.retries > self._alloc_retries:
                m.alloc_retries.inc(r.retries - self._alloc_retries)
            self._alloc_retries = r.retries

    def _write_drops(self) -> None:
        """Counters kept by other parts as plain ints (cheap on their hot paths), published as deltas."""
        spans = self._tracing.dropped()
        if spans > self._published["spans"]:
            self._m.spans_dropped.inc(spans - self._published["spans"])
            self._published["spans"] = spans
        collectives = self._tracker.dropped
        if collectives > self._published["collective"]:
            self._errors.drop("collective", "more completed collectives than buffered between two publishes",
                              collectives - self._published["collective"])
            self._published["collective"] = collectives


def write_step_values(m: RankMetrics, acc: Accumulator) -> None:
    """The last step's number, time, compute and observed values (loss, gradient norm, ...), written in one
    stretch between the fences (``RankMetrics.values_fence_*``): the exporter never takes one
    step's loss beside another step's gradient norm (rankscope.exporter.reader)."""
    if not (acc.steps or acc.observed or not math.isnan(acc.last_compute)):
        return
    m.values_written += 1
    m.values_fence_begin.set(m.values_written)
    if acc.steps:
        m.step_last.set(acc.last_duration)
        m.step_ts.set(acc.last_end)
        m.step.set(acc.last_step)
    if not math.isnan(acc.last_compute):
        m.step_last_compute.set(acc.last_compute)
    for name, number in acc.observed.items():
        m.observed[name].set(number)
    if not math.isnan(acc.loss_ema):
        m.loss_ema.set(acc.loss_ema)
        m.loss_z.set(acc.loss_z)
    m.values_fence_end.set(m.values_written)


def observe_all(histogram: Any, values: list[float]) -> None:
    """``histogram.observe(v)`` for each value, with one file write per bucket instead of two
    per value: a publish after 1,000 fast steps would otherwise hold the GIL for milliseconds.
    Falls back to ``observe`` if prometheus_client's histogram internals ever change."""
    if not values:
        return
    bounds, buckets, total = getattr(histogram, "_upper_bounds", None), getattr(histogram, "_buckets", None), \
        getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for v in values:
            histogram.observe(v)
        return
    counts = [0] * len(bounds)
    for v in values:
        counts[bisect.bisect_left(bounds, v)] += 1   # the first bound >= v, as observe() picks it
    for bucket, n in zip(buckets, counts):
        if n:
            bucket.inc(n)
    total.inc(math.fsum(values))
