"""What a finished step means: counts, durations, phases, values, anomalies.

The training thread hands each finished step over as it is (``step_ended``);
the publisher thread works out what it adds up to (``absorb``) into an
``Accumulator``, which it then swaps for an empty one and writes out. A step
is always counted, whatever its values: a bad value or a bug in judging it
can never make a training rank look stuck (a stall alert on a run that trains
is a false page).

Divergence is judged here, on every value, not on what a scrape happens to
see: a NaN or a one-step spike between two scrapes would otherwise be lost.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from rankscope import values
from rankscope.contract.catalog import PHASES
from rankscope.device_reads import DeviceStep
from rankscope.goodput import Progress, TimeUse
from rankscope.holds import LongestHold
from rankscope.health import GradNormTracker, LossTracker
from rankscope.records import PhaseRecord, StepRecord

MAX_PENDING_STEPS = 10_000   # step durations buffered between two publishes
SLOW_STEP_FACTOR = 3.0       # a step this many times the running median is traced as an anomaly
SLOW_STEP_FLOOR_S = 0.001    # ...if it took at least this long: µs-scale steps jitter by more than 3x
ABSORB_SLICE_S = 0.0003      # the publisher works through ended steps in slices this long...
GIL_YIELD_S = 0.0001         # ...sleeping this long between them (the GIL is free meanwhile)
HUNG_AFTER_S = 30.0          # a step open this long, and HUNG_FACTOR times the running median step,
HUNG_FACTOR = 10.0           # counts as idle (hung) from its start on, for goodput


class Accumulator:
    """What the training thread collected since the last publish."""

    __slots__ = ("steps", "durations", "phase", "samples", "tokens", "last_step", "last_duration",
                 "last_end", "losses", "grad_norms", "lr", "ooms", "nonfinite_loss", "nonfinite_grad",
                 "loss_spikes", "grad_spikes", "loss_ema", "loss_z", "data_waits", "wall")

    def __init__(self) -> None:
        self.steps = 0
        self.durations: list[float] = []
        self.phase = dict.fromkeys(PHASES, 0.0)
        self.samples = 0
        self.tokens = 0
        self.last_step = -1
        self.last_duration = 0.0
        self.last_end = 0.0
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
        self.wall: dict[str, float] = {}             # goodput category -> seconds (rankscope.goodput)


@dataclass(slots=True)
class TraceContext:
    """Enough of a step to trace it later (a CUDA anomaly is known only once the device is done)."""

    number: int
    start_unix: float
    t0: float
    duration: float
    phase_log: list[tuple[str, float, float]] = field(default_factory=list)
    samples: int = 0
    tokens: int = 0


@dataclass(frozen=True)
class JudgeSettings:
    loss_window: int
    loss_ema_alpha: float
    spike_zscore: float
    spike_warmup_steps: int
    grad_spike_factor: float


class StepAccounting:
    """Counts and judges finished steps.

    The training thread only hands over what it has (``step_ended``: a tuple
    appended to a deque, no lock, no reading of values); the publisher thread
    works out what it means (``absorb``) just before each publish. Right
    after a step's tensor work every line of Python runs cache-cold, several
    times slower than usual (docs/performance.md), so the less the training
    thread runs, the less the telemetry costs the step.
    """

    def __init__(self, judge: JudgeSettings, tracker: Any, tracing: Any,
                 device: Any, errors: Any, flush: Callable[[], None], time_use: TimeUse, progress: Progress,
                 under_way: Callable[[], tuple[float, float]]):
        self._time_use = time_use       # goodput: where the wall time goes
        self._progress = progress       # the highest step the run completed, kept for a relaunch
        # (since when the loop is in a step, fetch or block; since when the open step is) on perf_counter, 0: not
        self._under_way = under_way
        self._tracker = tracker
        self._tracing = tracing
        self._device = device           # device.RankDevice: CUDA values and phases are read through it once bound
        self._errors = errors
        self._flush = flush             # publish now (the process may be about to die)
        self._loss = LossTracker(judge.loss_window, judge.loss_ema_alpha, judge.spike_zscore,
                                 judge.spike_warmup_steps)
        self._grad = GradNormTracker(judge.grad_spike_factor)
        self._lock = threading.Lock()   # guards _acc: the publisher swaps it, an overflow counts into it
        self._acc = Accumulator()
        self._ended: deque[tuple] = deque()   # StepEnded tuples, training thread -> publisher
        self._median_step = 0.0
        self.steps_seen = 0
        self.hold = LongestHold()       # the longest slice of absorb() between two GIL releases

    def swap(self) -> Accumulator:
        """The publisher takes what was collected and leaves an empty accumulator."""
        with self._lock:
            acc, self._acc = self._acc, Accumulator()
        return acc

    # -- training thread -------------------------------------------------------
    def step_ended(self, s: Any, t1: float, exc: BaseException | None) -> None:
        if exc is not None:
            self._failed(s, t1, exc)
            return
        loss, grad, lr = s.loss, s.grad_norm, s.lr
        exposed = 0.0
        on_device = False
        try:
            comm = s.timer.comm   # the comm_timing strategy (Monitor.watch() may replace it)
            if comm.mode != "off":
                exposed = self._exposed_wait(comm, s)
                comm.step_ended()
            if self._device.events is not None or self._binds_device(loss, grad, lr):
                on_device = True
                loss, grad, lr = self._defer_to_device(s, t1, comm)
        except Exception:
            self._errors.error("step")
        self.steps_seen += 1   # after the device is bound: rank_info waits for this (rankscope.startup)
        # StepEnded, in this order (a plain tuple: the cheapest thing to build here).
        # A tensor's version counter is kept to tell whether it was modified before it is read.
        ended = (s.number, s.numbered, s.t0, t1, s.samples, s.tokens, s.data_unlogged, s.phase_log, exposed,
                 loss, None if loss is None or type(loss) is float else getattr(loss, "_version", None),
                 grad, None if grad is None or type(grad) is float else getattr(grad, "_version", None), lr,
                 on_device)
        if len(self._ended) < MAX_PENDING_STEPS:
            self._ended.append(ended)
        else:
            self._overflow(ended)

    def _exposed_wait(self, comm: Any, s: Any) -> float:
        if not s.backward_end:
            return 0.0
        backward = sum(b - a for name, a, b in s.phase_log if name == "backward")
        return comm.exposed_wait(s.backward_start, s.backward_end, backward)

    def _binds_device(self, *observed: Any) -> bool:
        """A rank whose CUDA device was not known (``Monitor()`` without one, no CUDA model
        watched) learns it from the first CUDA value it observes: from this step on, its
        values and phases are read from the device, never with a sync."""
        for value in observed:
            if value is None or type(value) is float:
                continue
            device = _cuda_device(value)
            if device is not None:
                return self._device.bind(device)
        return False

    def _defer_to_device(self, s: Any, t1: float, comm: Any) -> tuple[Any, Any, Any]:
        """CUDA: queue the phase events and the values' copies now, on the device's stream."""
        duration = t1 - s.t0
        data = s.data_unlogged + sum(b - a for name, a, b in s.phase_log if name == "data")
        reads = self._device.reads
        reads.defer_step(DeviceStep(duration, data, s.device_phases, comm.last_device_bucket()))
        context = _context(s, duration) if self._tracing.enabled else None
        return (self._defer_value(reads, "loss", s.loss, context),
                self._defer_value(reads, "grad_norm", s.grad_norm, context),
                self._defer_value(reads, "lr", s.lr, context))

    def _defer_value(self, reads: Any, what: str, value: Any, context: TraceContext | None) -> Any:
        """A device tensor (or a sequence holding one) is reduced here, on the training thread,
        and goes to the device reads (None is left); anything else is read later."""
        if value is None or type(value) is float or _cuda_device(value) is None:
            return value
        number = self._reduce(what, value)
        if number is not None:
            reads.defer_value(what, number, context)
        return None

    def _reduce(self, what: str, value: Any) -> Any:
        """``values.read``: a float or a 0-d device tensor; None (a counted drop) if not a number."""
        try:
            return values.read(what, value)
        except values.NotANumber as e:
            self._errors.drop("value", str(e))
            return None

    def _overflow(self, ended: tuple) -> None:
        """The publisher is far behind: count the step here, without its details."""
        number, _, t0, t1, samples, tokens = ended[:6]
        with self._lock:
            acc = self._acc
            acc.steps += 1
            acc.samples += samples
            acc.tokens += tokens
            acc.last_step, acc.last_duration = number, t1 - t0
            acc.last_end = time.time() - (time.perf_counter() - t1)
        self._errors.drop("step_duration", f"more than {MAX_PENDING_STEPS} steps between two publishes")

    def interval_ended(self, category: str, t0: float, t1: float) -> None:
        """A checkpoint or evaluation block (training thread)."""
        self._ended.append((category, t0, t1))

    def _failed(self, s: Any, t1: float, exc: BaseException) -> None:
        self._ended.append(("failed_step", s.t0, t1))
        if not _is_oom(exc):
            return
        try:
            with self._lock:
                self._acc.ooms += 1
            if self._tracing.enabled:
                self._trace(_context(s, t1 - s.t0), "oom", None)
            self._flush()
        except Exception:
            self._errors.error("step")

    # -- publisher thread ----------------------------------------------------------
    def absorb(self) -> None:
        """Work out what the steps that ended since the last call add up to (publisher thread).

        In slices of at most ``ABSORB_SLICE_S``, with a short sleep between
        them: the sleep releases the GIL, so the training thread, if it waits
        for it, never waits longer than a slice. Left alone, a thread keeps the
        GIL for Python's switch interval (5 ms) before it must hand it over."""
        # Read first: what is under way now is attributed when it ends, after this drain.
        busy, step_since = self._under_way()
        now = time.perf_counter()
        ended = self._ended
        to_unix = time.time() - now
        slice_end = now + ABSORB_SLICE_S
        self.hold.start()
        while ended:
            try:
                entry = ended.popleft()
                if len(entry) == 3:   # (category, t0, t1): an interval or a failed step
                    self._absorb_interval(*entry)
                else:
                    self._absorb_one(entry, to_unix)
            except Exception:
                self._errors.error("step")
            if time.perf_counter() > slice_end and ended:
                self.hold.stop()
                time.sleep(GIL_YIELD_S)
                self.hold.start()
                slice_end = time.perf_counter() + ABSORB_SLICE_S
        if step_since and now - step_since > max(HUNG_AFTER_S, HUNG_FACTOR * self._median_step):
            self._time_use.hung(step_since, now)   # a hang, or waiting on a hung peer: idle, not productive
        else:
            self._time_use.until(min(busy, now) if busy else now)
        wall = self._time_use.take()
        with self._lock:
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

    def _absorb_interval(self, category: str, t0: float, t1: float) -> None:
        if category == "failed_step":
            self._time_use.failed_step(t0, t1)
        else:
            self._time_use.interval(category, t0, t1)

    def _absorb_one(self, ended: tuple, to_unix: float) -> None:
        (number, numbered, t0, t1, samples, tokens, data_unlogged, log, exposed,
         loss, loss_version, grad, grad_version, lr, on_device) = ended
        duration = t1 - t0
        waits = [b - a for name, a, b in log if name == "data"]
        data = data_unlogged + sum(waits)
        phases = self._phases(log, data_unlogged, duration, exposed, on_device)
        self._time_use.step(number, numbered, t0, t1, data)
        start_unix = t0 + to_unix
        with self._lock:
            acc = self._acc
            acc.steps += 1
            acc.durations.append(duration)
            acc.data_waits.extend(waits)
            for k, v in phases.items():
                acc.phase[k] += v
            acc.samples += samples
            acc.tokens += tokens
            acc.last_step = number
            acc.last_duration = duration
            acc.last_end = start_unix + duration
        loss = self._read("loss", loss, loss_version)
        grad = self._read("grad_norm", grad, grad_version)
        lr = self._read("lr", lr, None)
        anomaly = ""
        with self._lock:
            acc = self._acc
            if loss is not None:
                anomaly = self._judge_loss(loss, acc)
            if grad is not None:
                grad_anomaly = self._judge_grad(grad, acc)
                anomaly = anomaly or grad_anomaly   # the loss is the primary signal
            if lr is not None:
                acc.lr = lr
        median = self._median_step
        self._median_step = duration if not median else median + 0.05 * (duration - median)
        if not anomaly and median and number > 10 and duration > SLOW_STEP_FACTOR * median \
                and duration >= SLOW_STEP_FLOOR_S:
            anomaly = "slow_step"
        if self._tracing.enabled and (anomaly or self._tracing.sampled(number)):
            self._trace(TraceContext(number, start_unix, t0, duration, log, samples, tokens), anomaly, loss)

    def _phases(self, log: list, data_unlogged: float, duration: float, exposed: float,
                on_device: bool) -> dict[str, float]:
        """Seconds per phase from the step's log; on CUDA only the data wait (the rest comes from events)."""
        phases = dict.fromkeys(PHASES, 0.0)
        phases["data"] = data_unlogged
        for name, a, b in log:
            phases[name] += b - a
        if on_device:
            return dict.fromkeys(PHASES, 0.0) | {"data": phases["data"]}
        exposed = min(exposed, phases["backward"])
        phases["backward"] -= exposed
        phases["comm_wait"] += exposed
        phases["other"] += max(duration - sum(phases.values()), 0.0)
        return phases

    def _read(self, what: str, value: Any, version: int | None) -> float | None:
        """The value as a float, or None (absent, already deferred to the device, or dropped)."""
        number = None if value is None else self._reduce(what, value)
        if number is None:
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

    # -- judging (publisher thread, under the lock, every value exactly once) --------
    def _judge_loss(self, loss: float, acc: Accumulator) -> str:
        verdict = self._loss.observe(loss)
        acc.losses.append(loss)
        if verdict.nonfinite:
            acc.nonfinite_loss += 1
            return "nonfinite_loss"
        acc.loss_ema, acc.loss_z = verdict.ema, verdict.zscore
        if verdict.spike:
            acc.loss_spikes += 1
            return "loss_spike"
        return ""

    def _judge_grad(self, norm: float, acc: Accumulator) -> str:
        nonfinite, explosion = self._grad.observe(norm)
        acc.grad_norms.append(norm)
        if nonfinite:
            acc.nonfinite_grad += 1
            return "nonfinite_grad"
        if explosion:
            acc.grad_spikes += 1
            return "grad_spike"
        return ""

    # -- publisher thread: values and phases the device has finished ---------------
    def device_value_ready(self, what: str, number: float, step: TraceContext | None) -> None:
        """A CUDA ``loss``, ``grad_norm`` or ``lr`` value, read once the device was done with it."""
        with self._lock:
            if what == "lr":
                self._acc.lr = number
                return
            judge = self._judge_loss if what == "loss" else self._judge_grad
            anomaly = judge(number, self._acc)
        if anomaly and step is not None:
            # The loss is the primary signal; a grad anomaly is traced with no loss value.
            self._trace(step, anomaly, number if what == "loss" else None)

    def device_phases_ready(self, phases: dict[str, float]) -> None:
        with self._lock:
            for k, v in phases.items():
                self._acc.phase[k] += v

    def _trace(self, c: TraceContext, anomaly: str, loss: float | None) -> None:
        base = c.start_unix - c.t0  # perf_counter -> unix seconds
        end = c.start_unix + c.duration
        self._tracing.submit(StepRecord(
            step=c.number, start=c.start_unix, duration=c.duration,
            phases=[PhaseRecord(name, base + a, b - a) for name, a, b in c.phase_log],
            collectives=self._tracker.recent_between(c.start_unix, end),
            samples=c.samples, tokens=c.tokens, loss=loss, anomaly=anomaly,
        ))


def _context(s: Any, duration: float) -> TraceContext:
    start_unix = time.time() - (time.perf_counter() - s.t0)
    return TraceContext(s.number, start_unix, s.t0, duration, s.phase_log, s.samples, s.tokens)


def _cuda_device(value: Any) -> Any:
    """The device of a CUDA tensor, or of the first one in a list or tuple; None otherwise."""
    if getattr(value, "is_cuda", False):
        return value.device
    if isinstance(value, (list, tuple)):
        for item in value:
            if getattr(item, "is_cuda", False):
                return item.device
    return None


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"
