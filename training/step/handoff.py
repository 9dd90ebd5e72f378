"""The training thread's side of the step path: each finished step is handed over as it is.

When a step ends, the training thread appends one record laid out as
``StepEnded`` to a deque (a plain tuple: the cheapest thing to build): no lock,
no reading of values, no judging (the publisher does all that,
``rankscope.step.accounting``). Right after a step's tensor work every line of
Python runs cache-cold, several times slower than usual (docs/performance.md),
so the less the training thread runs, the less the telemetry costs the step.

What it does do, because only it can:

* on CUDA, queue the step's phase events and its values' copies on the device's
  stream (``rankscope.device.reads``), reducing a list of device values there
  without a sync; a ``Monitor()`` made without a device learns it from the
  first CUDA value;
* keep each tensor value's version counter, so that one modified in place
  before it is read is dropped, never misreported;
* count a step the publisher has no room for (far behind), without its details;
* on an out-of-memory error inside a step, count it and ask for a publish now
  (``PublishNow``): the process may be about to die.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from rankscope.device.rank_device import RankDevice
from rankscope.device.reads import DeviceStep
from rankscope.errors import TelemetryErrors
from rankscope.step import values
from rankscope.step.observed import NAMES, OBSERVED_VALUES
from rankscope.step.records import IntervalEnded, Overflow, StepEnded, TraceContext
from rankscope.step.trace_feed import TraceFeed
from rankscope.step.watched import Watched

if TYPE_CHECKING:
    from rankscope.collectives.comm_timing import CommTiming
    from rankscope.device.reads import DeviceReads
    from rankscope.step.timer import Step

MAX_PENDING_STEPS = 10_000   # finished steps buffered between two publishes
OOM_PUBLISH_WAIT_S = 1.0     # how long the training thread waits for the publish an OOM asks for
_NO_VERSIONS = (None,) * len(OBSERVED_VALUES)   # a step that observed no tensor: no version to check


class PublishNow:
    """The training thread asks for a publish and waits for it, bounded; the publisher thread
    sleeps between publishes until asked (or its interval passes)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._asked = 0        # requests made
        self._served = 0       # requests a finished publish has covered
        self._woken = False    # stop(): end the publisher's wait now

    def ask(self, timeout_s: float = OOM_PUBLISH_WAIT_S) -> bool:
        """Ask for a publish; True once one that began after this call has finished."""
        with self._cond:
            self._asked += 1
            wanted = self._asked
            self._cond.notify_all()
            return self._cond.wait_for(lambda: self._served >= wanted, timeout_s)

    def wait(self, timeout_s: float) -> int:
        """Publisher thread: sleep until asked, woken or ``timeout_s``; the requests a publish
        started now covers (pass them to ``served`` once it has finished)."""
        with self._cond:
            self._cond.wait_for(lambda: self._asked > self._served or self._woken, timeout_s)
            return self._asked

    def served(self, upto: int) -> None:
        with self._cond:
            self._served = max(self._served, upto)
            self._cond.notify_all()

    def wake(self) -> None:
        with self._cond:
            self._woken = True
            self._cond.notify_all()


class StepHandoff:
    """Hands each finished step and interval to the publisher (training thread)."""

    def __init__(self, device: RankDevice, watched: Watched, errors: TelemetryErrors, trace_feed: TraceFeed):
        self._device = device
        self._watched = watched   # the comm timing and the replica check, as watch() left them
        # A host without CUDA never sees a CUDA value: its steps skip looking for one (a few
        # attribute reads per value, cache-cold right after the step's tensor work).
        self._cuda_possible = device.api.available()
        self._errors = errors
        self._trace_feed = trace_feed
        # Taken by the publisher, oldest first: IntervalEnded records, and finished steps as plain
        # tuples laid out as StepEnded.
        self.entries: deque[tuple | IntervalEnded] = deque()
        self.publish_now = PublishNow()
        self.steps_seen = 0          # completed steps handed over (read by rank_info)
        self.ooms = 0                # out-of-memory errors inside steps, cumulative (the publisher takes deltas)
        self._overflow = Overflow()
        self._overflow_lock = threading.Lock()

    # -- training thread -------------------------------------------------------
    def step_ended(self, s: Step, t1: float, exc: BaseException | None) -> None:
        """``s``: the step that just ended (its fields are read here, once)."""
        if exc is not None:
            self._failed(s, t1, exc)
            return
        observed = s.values
        exposed = 0.0
        on_device = False
        watched = self._watched
        try:
            comm = watched.comm
            if comm.mode != "off":
                exposed = self._exposed_wait(comm, s)
                comm.step_ended()
            if self._device.events is not None or self._cuda_possible and (
                    any(v is not None and type(v) is not float for v in observed) and self._binds_device(observed)):
                on_device = True
                observed = self._defer_to_device(s, t1, comm)
        except Exception:
            self._errors.error("step")
        self.steps_seen += 1   # after the device is bound: rank_info waits for this (rankscope.publishing.startup)
        versions = _NO_VERSIONS
        for v in observed:
            if v is not None and type(v) is not float:   # a tensor among them: every one's version counter
                versions = [None if w is None or type(w) is float else getattr(w, "_version", None) for w in observed]
                break
        # A plain tuple laid out as StepEnded (the publisher reads it as one): the cheapest thing to
        # build here, where every line runs cache-cold.
        ended = (s.number, s.numbered, s.t0, t1, s.samples, s.tokens, s.data_unlogged, s.phase_log, exposed,
                 observed, versions, on_device)
        if len(self.entries) < MAX_PENDING_STEPS:
            self.entries.append(ended)
        else:
            self._overflowed(ended)
        check = watched.replica_check
        if check is not None and not s.number % check.every:
            try:
                check.step_ended(s.number)
            except Exception:
                self._errors.error("replicas")

    def interval_ended(self, category: str, t0: float, t1: float) -> None:
        """A checkpoint or evaluation block."""
        self.entries.append(IntervalEnded(category, t0, t1))

    def take_overflow(self) -> Overflow:
        """Publisher thread: the steps counted without details since the last call."""
        with self._overflow_lock:
            overflow, self._overflow = self._overflow, Overflow()
        return overflow

    # -- the parts of a step end -------------------------------------------------
    def _exposed_wait(self, comm: CommTiming, s: Step) -> float:
        if not s.backward_end:
            return 0.0
        backward = sum(b - a for name, a, b in s.phase_log if name == "backward")
        return comm.exposed_wait(s.backward_start, s.backward_end, backward)

    def _binds_device(self, observed: list[Any]) -> bool:
        """A rank whose CUDA device was not known (``Monitor()`` without one, no CUDA model
        watched) learns it from the first CUDA value it observes: from this step on, its
        values and phases are read from the device, never with a sync."""
        for value in observed:
            if value is None or type(value) is float:
                continue
            index = self._device.device_of(value)
            if index is not None:
                return self._device.bind(index)
        return False

    def _defer_to_device(self, s: Step, t1: float, comm: CommTiming) -> list[Any]:
        """CUDA: queue the phase events and the values' copies now, on the device's stream."""
        duration = t1 - s.t0
        data = s.data_unlogged + sum(b - a for name, a, b in s.phase_log if name == "data")
        reads = self._device.reads
        reads.defer_step(DeviceStep(duration, data, s.device_phases, comm.last_device_bucket()))
        context = self._trace_feed.context_of(s, duration) if self._trace_feed.enabled else None
        return [self._defer_value(reads, name, value, context) for name, value in zip(NAMES, s.values)]

    def _defer_value(self, reads: DeviceReads, what: str, value: Any, context: TraceContext | None) -> Any:
        """A device tensor (or a sequence holding one) is reduced here, on the training thread,
        and goes to the device reads (None is left); anything else is read later."""
        if value is None or type(value) is float or self._device.device_of(value) is None:
            return value
        try:
            number = values.read(what, value, self._device.api.device_of)
        except values.NotANumber as e:
            self._errors.drop("value", str(e))
            return None
        reads.defer_value(what, number, context)
        return None

    def _overflowed(self, ended: tuple) -> None:
        """The publisher is far behind: count the step here, without its details."""
        ended = StepEnded._make(ended)
        with self._overflow_lock:
            o = self._overflow
            o.steps += 1
            o.samples += ended.samples
            o.tokens += ended.tokens
            o.last_step, o.last_duration = ended.number, ended.t1 - ended.t0
            o.last_end = time.time() - (time.perf_counter() - ended.t1)
        self._errors.drop("step_duration", f"more than {MAX_PENDING_STEPS} steps between two publishes")

    def _failed(self, s: Step, t1: float, exc: BaseException) -> None:
        self.entries.append(IntervalEnded("failed_step", s.t0, t1))
        if not _is_oom(exc):
            return
        self.ooms += 1
        try:
            if self._trace_feed.enabled:
                self._trace_feed.submit(self._trace_feed.context_of(s, t1 - s.t0), "oom", None)
        except Exception:
            self._errors.error("step")
        self.publish_now.ask()   # bounded: the count reaches the files before the process may die


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"
