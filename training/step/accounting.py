"""What the finished steps add up to: counts, durations, phases, values (publisher thread).

The training thread hands each finished step over as it is
(``rankscope.step.handoff``); before each publish the publisher has them
worked out here (``absorb``) into an ``Accumulator``, which it then takes
(``swap``) and writes out. A step is always counted, whatever its values: a
bad value or a bug in judging it can never make a training rank look stuck (a
stall alert on a run that trains is a false page).

Each value is read here by the rules of ``rankscope.step.values``, judged once
(``rankscope.step.judging``: divergence is judged on every value, not on what a
scrape happens to see), and the step is traced if it is sampled or anomalous
(``rankscope.step.trace_feed``). Its time goes to goodput
(``rankscope.step.goodput``).
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any, Protocol

from rankscope.contract.catalog import PHASES
from rankscope.contract.thresholds import STRAGGLER_PHASES
from rankscope.errors import TelemetryErrors
from rankscope.holds import LongestHold
from rankscope.step import values
from rankscope.step.goodput import Progress, TimeUse
from rankscope.step.judging import Judge
from rankscope.step.records import IntervalEnded, StepEnded, TraceContext
from rankscope.step.trace_feed import TraceFeed

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

    comm: Any   # how DDP's wait in backward is known (rankscope.collectives.comm_timing)

    def busy_since(self) -> float: ...

    def open_step_since(self) -> float: ...


class Accumulator:
    """What the steps worked out since the last publish add up to."""

    __slots__ = ("steps", "durations", "phase", "samples", "tokens", "last_step", "last_duration",
                 "last_end", "last_compute", "losses", "grad_norms", "lr", "ooms", "nonfinite_loss",
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
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.lr = math.nan
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
    """Works out the finished steps (publisher thread only)."""

    def __init__(self, judge: Judge, trace_feed: TraceFeed, time_use: TimeUse, progress: Progress,
                 loop: UnderWay, errors: TelemetryErrors):
        self._judge = judge
        self._trace_feed = trace_feed
        self._time_use = time_use       # goodput: where the wall time goes
        self._progress = progress       # the highest step the run completed, kept for a relaunch
        self._loop = loop
        self._errors = errors
        self._acc = Accumulator()
        self.hold = LongestHold()       # the longest slice of absorb() between two GIL releases

    def swap(self) -> Accumulator:
        """The publisher takes what was worked out and leaves an empty accumulator."""
        acc, self._acc = self._acc, Accumulator()
        return acc

    # -- the steps that ended ---------------------------------------------------------
    def absorb(self, entries: deque) -> None:
        """Work out the records that ended since the last call, oldest first.

        In slices of at most ``ABSORB_SLICE_S``, with a short sleep between
        them: the sleep releases the GIL, so the training thread, if it waits
        for it, never waits longer than a slice. Left alone, a thread keeps the
        GIL for Python's switch interval (5 ms) before it must hand it over."""
        # Read first: what is under way now is attributed when it ends, after this drain.
        busy, step_since = self._loop.busy_since(), self._loop.open_step_since()
        now = time.perf_counter()
        to_unix = time.time() - now
        slice_end = now + ABSORB_SLICE_S
        self.hold.start()
        while entries:
            try:
                entry = entries.popleft()
                if type(entry) is IntervalEnded:
                    self._absorb_interval(entry)
                else:
                    self._absorb_step(StepEnded._make(entry), to_unix)
            except Exception:
                self._errors.error("step")
            if time.perf_counter() > slice_end and entries:
                self.hold.stop()
                time.sleep(GIL_YIELD_S)
                self.hold.start()
                slice_end = time.perf_counter() + ABSORB_SLICE_S
        self._time_use.settle(now, busy, step_since, self._judge.median_step)
        wall = self._time_use.take()
        acc_wall = self._acc.wall
        for k, v in wall.items():
            acc_wall[k] = acc_wall.get(k, 0.0) + v
        self.hold.stop()
        # Its own stretch: a file write and a rename, whose system calls let the GIL go
        # but count in this thread's CPU time.
        time.sleep(GIL_YIELD_S)
        self.hold.start()
        self._progress.save(self._time_use.highest_step)
        self.hold.stop()

    def _absorb_interval(self, entry: IntervalEnded) -> None:
        if entry.category == "failed_step":
            self._time_use.failed_step(entry.t0, entry.t1)
        else:
            self._time_use.interval(entry.category, entry.t0, entry.t1)

    def _absorb_step(self, e: StepEnded, to_unix: float) -> None:
        duration = e.t1 - e.t0
        waits = [b - a for name, a, b in e.phase_log if name == "data"]
        data = e.data_unlogged + sum(waits)
        self._time_use.step(e.number, e.numbered, e.t0, e.t1, data)
        start_unix = e.t0 + to_unix
        acc = self._acc
        acc.steps += 1
        acc.durations.append(duration)
        acc.data_waits.extend(waits)
        phases = self._phases(e, duration)
        for k, v in phases.items():
            acc.phase[k] += v
        if not e.on_device:   # a CUDA step's phases come later (device_phases_ready)
            acc.last_compute = compute_seconds(phases, self._loop.comm.waits_known_each_step)
        acc.samples += e.samples
        acc.tokens += e.tokens
        acc.last_step = e.number
        acc.last_duration = duration
        acc.last_end = start_unix + duration
        loss = self._read("loss", e.loss, e.loss_version)
        grad = self._read("grad_norm", e.grad_norm, e.grad_version)
        lr = self._read("lr", e.lr, None)
        anomaly = ""
        if loss is not None:
            anomaly = self._judge.loss(loss, acc)
        if grad is not None:
            grad_anomaly = self._judge.grad_norm(grad, acc)
            anomaly = anomaly or grad_anomaly   # the loss is the primary signal
        if lr is not None:
            acc.lr = lr
        if self._judge.slow_step(e.number, duration) and not anomaly:
            anomaly = "slow_step"
        if self._trace_feed.enabled:
            self._trace_feed.step(TraceContext(e.number, start_unix, e.t0, duration, e.phase_log, e.samples,
                                               e.tokens), anomaly, loss)

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

    # -- what the device has finished --------------------------------------------------
    def device_value_ready(self, what: str, number: float, step: TraceContext | None) -> None:
        """A CUDA ``loss``, ``grad_norm`` or ``lr`` value, read once the device was done with it."""
        acc = self._acc
        if what == "lr":
            acc.lr = number
            return
        anomaly = self._judge.loss(number, acc) if what == "loss" else self._judge.grad_norm(number, acc)
        if anomaly and step is not None:
            # The loss is the primary signal; a grad anomaly is traced with no loss value.
            self._trace_feed.submit(step, anomaly, number if what == "loss" else None)

    def device_phases_ready(self, phases: dict[str, float]) -> None:
        for k, v in phases.items():
            self._acc.phase[k] += v
        self._acc.last_compute = compute_seconds(phases, self._loop.comm.waits_known_each_step)
