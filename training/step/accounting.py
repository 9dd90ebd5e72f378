"""What the finished steps add up to: counts, durations, phases, values (publisher thread).

The training thread hands each finished step over as it is
(``rankscope.step.handoff``); once per publish the publisher gives this module
everything that arrived since the last one, in one call (``take``): the ended
steps and intervals, what the CUDA device finished (values, phases: entries of
their own kinds, ``rankscope.step.records``), the steps counted without details
and the out-of-memory count. It returns their totals (an ``Accumulator``),
which it alone writes. A step is always counted, whatever its values: a bad
value or a bug in judging it can never make a training rank look stuck (a
stall alert on a run that trains is a false page).

Each value is read here by the rules of ``rankscope.step.values``, judged once
(``rankscope.step.judging`` returns a verdict, applied here: divergence is
judged on every value, not on what a scrape happens to see), and the step is
traced if it is sampled or anomalous (``rankscope.step.trace_feed``). Its time
goes to goodput (``rankscope.step.goodput``).
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any, Callable, Iterable, Iterator, Protocol

from rankscope.contract.catalog import PHASES
from rankscope.contract.thresholds import STRAGGLER_PHASES
from rankscope.errors import TelemetryErrors
from rankscope.holds import LongestHold
from rankscope.step import values
from rankscope.step.goodput import Progress, TimeUse
from rankscope.step.judging import Judge, Verdict
from rankscope.step.observed import NAMES, VERSIONED
from rankscope.step.records import DevicePhasesRead, DeviceValueRead, IntervalEnded, Overflow, StepEnded, TraceContext
from rankscope.step.trace_feed import TraceFeed
from rankscope.step.watched import Watched

ABSORB_SLICE_S = 0.0003      # the publisher works through ended steps in slices this long...
GIL_YIELD_S = 0.0001         # ...sleeping this long between them (the GIL is free meanwhile)


def compute_seconds(phases: dict[str, float], with_backward: bool = True) -> float:
    """A step's own work, in the phases the straggler rules compare between ranks; its spread
    across the ranks of a stage, step by step, is the load imbalance
    (rankscope_step_last_compute_seconds). Backward is left out where it holds the step's wait
    for its peers, which is then known only as an estimate (DDP's timers sample one step in ten):
    that wait, not the work, would vary from step to step."""
    return sum(phases.get(name, 0.0) for name in STRAGGLER_PHASES if with_backward or name != "backward")


class UnderWay(Protocol):
    """What the loop is doing now (``rankscope.step.timer.StepTimer``), read by the publisher."""

    def busy_since(self) -> float: ...

    def open_step_since(self) -> float: ...


class Accumulator:
    """What the steps worked out since the last publish add up to."""

    __slots__ = ("steps", "durations", "phase", "samples", "tokens", "last_step", "last_duration",
                 "last_end", "last_compute", "observed", "ooms", "nonfinite_loss",
                 "nonfinite_grad", "loss_spikes", "grad_spikes", "loss_ema", "loss_z", "data_waits", "wall")

    def __init__(self) -> None:
        self.steps = 0
        self.durations: list[float] = []
        self.phase = dict.fromkeys(PHASES, 0.0)
        self.samples = 0
        self.tokens = 0
        self.last_step = -1
        self.last_duration = 0.0
        self.last_end = 0.0
        self.last_compute = math.nan               # the last step's compute seconds (STRAGGLER_PHASES)
        self.observed: dict[str, float] = {}       # each observed value's last reading (rankscope.step.observed)
        self.ooms = 0
        self.nonfinite_loss = 0
        self.nonfinite_grad = 0
        self.loss_spikes = 0
        self.grad_spikes = 0
        self.loss_ema = math.nan
        self.loss_z = math.nan
        self.data_waits: list[float] = []            # each batch's wait
        self.wall: dict[str, float] = {}             # goodput category -> seconds (rankscope.step.goodput)


class StepAccounting:
    """Works out what arrived since the last publish (publisher thread only)."""

    def __init__(self, judge: Judge, trace_feed: TraceFeed, time_use: TimeUse, progress: Progress,
                 loop: UnderWay, watched: Watched, errors: TelemetryErrors):
        self._judge = judge
        self._trace_feed = trace_feed
        self._time_use = time_use       # goodput: where the wall time goes
        self._progress = progress       # the highest step the run completed, kept for a relaunch
        self._loop = loop
        self._watched = watched         # how DDP's wait in backward is known (its comm timing)
        self._errors = errors
        self._ooms_taken = 0
        self.hold = LongestHold()       # the longest slice of take() between two GIL releases
        # One handler per kind of entry: the step path's records (rankscope.step.records).
        self._handlers: dict[type, Callable[[Any, Accumulator, float], None]] = {
            tuple: self._step, IntervalEnded: self._interval,
            DeviceValueRead: self._device_value, DevicePhasesRead: self._device_phases}
        # The observed values a judge watches (rankscope.step.judging); the others are kept as read.
        self._judged: dict[str, Callable[[float, Accumulator], str]] = {
            "loss": self._apply_loss, "grad_norm": self._apply_grad_norm}

    def take(self, entries: deque, device: Iterable[DeviceValueRead | DevicePhasesRead], overflow: Overflow,
             ooms: int) -> Accumulator:
        """Everything since the last call, worked out: the steps and intervals that ended (taken
        from ``entries``, oldest first), then what the device finished, the steps counted without
        details, and the out-of-memory errors (``ooms``: the count so far). Returns the totals.

        In slices of at most ``ABSORB_SLICE_S``, with a short sleep between
        them: the sleep releases the GIL, so the training thread, if it waits
        for it, never waits longer than a slice. Left alone, a thread keeps the
        GIL for Python's switch interval (5 ms) before it must hand it over."""
        acc = Accumulator()
        # Read first: what is under way now is attributed when it ends, after this drain.
        busy, step_since = self._loop.busy_since(), self._loop.open_step_since()
        now = time.perf_counter()
        to_unix = time.time() - now
        slice_end = now + ABSORB_SLICE_S
        handlers = self._handlers
        self.hold.start()
        for entry in _oldest_first(entries, device):
            try:
                handlers[type(entry)](entry, acc, to_unix)
            except Exception:
                self._errors.error("step")
            if time.perf_counter() > slice_end:
                self.hold.stop()
                time.sleep(GIL_YIELD_S)
                self.hold.start()
                slice_end = time.perf_counter() + ABSORB_SLICE_S
        self._time_use.settle(now, busy, step_since, self._judge.median_step)
        acc.wall = self._time_use.take()
        _add_overflow(acc, overflow)
        acc.ooms, self._ooms_taken = ooms - self._ooms_taken, ooms
        self.hold.stop()
        # Its own stretch: a file write and a rename, whose system calls let the GIL go
        # but count in this thread's CPU time.
        time.sleep(GIL_YIELD_S)
        self.hold.start()
        self._progress.save(self._time_use.highest_step)
        self.hold.stop()
        return acc

    # -- one handler per kind of entry ----------------------------------------------------
    def _interval(self, entry: IntervalEnded, acc: Accumulator, to_unix: float) -> None:
        if entry.category == "failed_step":
            self._time_use.failed_step(entry.t0, entry.t1)
        else:
            self._time_use.interval(entry.category, entry.t0, entry.t1)

    def _step(self, entry: tuple, acc: Accumulator, to_unix: float) -> None:
        e = StepEnded._make(entry)
        duration = e.t1 - e.t0
        waits = [b - a for name, a, b in e.phase_log if name == "data"]
        data = e.data_unlogged + sum(waits)
        self._time_use.step(e.number, e.numbered, e.t0, e.t1, data)
        start_unix = e.t0 + to_unix
        acc.steps += 1
        acc.durations.append(duration)
        acc.data_waits.extend(waits)
        phases = self._phases(e, duration)
        for k, v in phases.items():
            acc.phase[k] += v
        if not e.on_device:   # a CUDA step's phases come later (DevicePhasesRead)
            acc.last_compute = compute_seconds(phases, self._watched.comm.waits_known_each_step)
        acc.samples += e.samples
        acc.tokens += e.tokens
        acc.last_step = e.number
        acc.last_duration = duration
        acc.last_end = start_unix + duration
        anomaly = ""
        loss = None
        for name, value, version, versioned in zip(NAMES, e.values, e.versions, VERSIONED):
            number = self._read(name, value, version if versioned else None)
            if number is None:
                continue
            found = self._apply(name, number, acc)
            anomaly = anomaly or found   # the first value's: the loss is the primary signal
            if name == "loss":
                loss = number            # traced with the step
        if self._judge.slow_step(e.number, duration) and not anomaly:
            anomaly = "slow_step"
        if self._trace_feed.enabled:
            self._trace_feed.step(TraceContext(e.number, start_unix, e.t0, duration, e.phase_log, e.samples,
                                               e.tokens), anomaly, loss)

    def _device_value(self, entry: DeviceValueRead, acc: Accumulator, to_unix: float) -> None:
        what, number, step = entry
        anomaly = self._apply(what, number, acc)
        if anomaly and step is not None:
            # The loss is the primary signal; a grad anomaly is traced with no loss value.
            self._trace_feed.submit(step, anomaly, number if what == "loss" else None)

    def _device_phases(self, entry: DevicePhasesRead, acc: Accumulator, to_unix: float) -> None:
        for k, v in entry.phases.items():
            acc.phase[k] += v
        acc.last_compute = compute_seconds(entry.phases, self._watched.comm.waits_known_each_step)

    # -- the verdicts, applied ------------------------------------------------------------
    def _apply(self, name: str, number: float, acc: Accumulator) -> str:
        """An observed value's reading: kept as its last, and judged if a judge watches it."""
        acc.observed[name] = number
        judged = self._judged.get(name)
        return judged(number, acc) if judged is not None else ""

    def _apply_loss(self, loss: float, acc: Accumulator) -> str:
        verdict: Verdict = self._judge.loss(loss)
        if verdict.anomaly == "nonfinite_loss":
            acc.nonfinite_loss += 1
        else:
            acc.loss_ema, acc.loss_z = verdict.ema, verdict.zscore
            acc.loss_spikes += verdict.anomaly == "loss_spike"
        return verdict.anomaly

    def _apply_grad_norm(self, norm: float, acc: Accumulator) -> str:
        verdict = self._judge.grad_norm(norm)
        acc.nonfinite_grad += verdict.anomaly == "nonfinite_grad"
        acc.grad_spikes += verdict.anomaly == "grad_spike"
        return verdict.anomaly

    @staticmethod
    def _phases(e: StepEnded, duration: float) -> dict[str, float]:
        """Seconds per phase from the step's log; on CUDA only the data wait (the rest comes from events)."""
        phases = dict.fromkeys(PHASES, 0.0)
        phases["data"] = e.data_unlogged
        for name, a, b in e.phase_log:
            phases[name] += b - a
        if e.on_device:
            return dict.fromkeys(PHASES, 0.0) | {"data": phases["data"]}
        exposed = min(e.exposed, phases["backward"])
        phases["backward"] -= exposed
        phases["comm_wait"] += exposed
        phases["other"] += max(duration - sum(phases.values()), 0.0)
        return phases

    def _read(self, what: str, value: Any, version: int | None) -> float | None:
        """The value as a float, or None (absent, already deferred to the device, or dropped)."""
        if value is None:
            return None
        try:
            number = values.read(what, value)
        except values.NotANumber as e:
            self._errors.drop("value", str(e))
            return None
        if version is not None and getattr(value, "_version", version) != version:
            self._errors.drop("value_modified", f"{what}: the tensor given to step.observe() was modified in "
                                                "place after its step ended; observe a copy (loss.item() or "
                                                "loss.detach().clone()) if the loop reuses it")
            return None
        if isinstance(number, float):
            return number
        # A device value that was not deferred (a step that failed to defer it): never read with a sync.
        self._errors.drop("value", f"{what}: a CUDA value the device reads did not take")
        return None


def _oldest_first(entries: deque, device: Iterable) -> Iterator:
    """The handed-over entries, taken as they are read (an entry handed over meanwhile is taken
    too; one left by a failed publish stays for the next), then the device's."""
    while entries:
        yield entries.popleft()
    yield from device


def _add_overflow(acc: Accumulator, overflow: Overflow) -> None:
    """Steps the training thread counted without details (the publisher was far behind)."""
    if not overflow.steps:
        return
    acc.steps += overflow.steps
    acc.samples += overflow.samples
    acc.tokens += overflow.tokens
    if overflow.last_end >= acc.last_end:
        acc.last_step, acc.last_duration, acc.last_end = overflow.last_step, overflow.last_duration, overflow.last_end
