"""What a finished step means: counts, durations, phases, values, anomalies.

Called on the training thread when a step ends. Everything lands in an
``Accumulator`` under a lock; the publisher swaps it for an empty one and
writes it out. The order inside ``step_ended`` is deliberate: the step is
counted first, by code that cannot fail, so a bad value or a bug further down
can never make a training rank look stuck (a stall alert on a run that trains
is a false page).

Divergence is judged here, on every value, not on what a scrape happens to
see: a NaN or a one-step spike between two scrapes would otherwise be lost.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from rankscope import values
from rankscope.contract.catalog import PHASES
from rankscope.device_reads import DeviceStep, DeviceValue
from rankscope.health import GradNormTracker, LossTracker
from rankscope.records import PhaseRecord, StepRecord

MAX_PENDING_STEPS = 10_000   # step durations buffered between two publishes
SLOW_STEP_FACTOR = 3.0       # a step this many times the running median is traced as an anomaly
SLOW_STEP_FLOOR_S = 0.001    # ...if it took at least this long: µs-scale steps jitter by more than 3x


class Accumulator:
    """What the training thread collected since the last publish."""

    __slots__ = ("steps", "durations", "phase", "samples", "tokens", "last_step", "last_duration",
                 "last_end", "losses", "grad_norms", "lr", "ooms", "nonfinite_loss", "nonfinite_grad",
                 "loss_spikes", "grad_spikes", "loss_ema", "loss_z")

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
    def __init__(self, judge: JudgeSettings, comm: Callable[[], Any], tracker: Any, tracing: Any,
                 device: Any, errors: Any, flush: Callable[[], None]):
        self._comm = comm               # the current comm_timing strategy (watch() may replace it)
        self._tracker = tracker
        self._tracing = tracing
        self._device = device           # device_reads.DeviceReads on CUDA, else None
        self._errors = errors
        self._flush = flush             # publish now (the process may be about to die)
        self._loss = LossTracker(judge.loss_window, judge.loss_ema_alpha, judge.spike_zscore,
                                 judge.spike_warmup_steps)
        self._grad = GradNormTracker(judge.grad_spike_factor)
        self._lock = threading.Lock()
        self._acc = Accumulator()
        self._median_step = 0.0
        self.steps_seen = 0

    def swap(self) -> Accumulator:
        """The publisher takes what was collected and leaves an empty accumulator."""
        with self._lock:
            acc, self._acc = self._acc, Accumulator()
        return acc

    # -- training thread -------------------------------------------------------
    def step_ended(self, s: Any, t1: float, exc: BaseException | None) -> None:
        if exc is not None:
            if _is_oom(exc):
                self._oom(s, t1)
            return
        duration = t1 - s.t0
        phases = self._phases(s, duration)
        self._count(s, duration, phases)
        try:
            self._comm().step_ended()
            tracing = self._tracing.enabled
            # A CUDA value is judged later, so its step must be kept to trace it then.
            context = _context(s, duration) if tracing and self._device is not None else None
            loss, anomaly = self._judge_values(s, context)
            median = self._median_step
            self._median_step = duration if not median else median + 0.05 * (duration - median)
            if not anomaly and median and s.number > 10 and duration > SLOW_STEP_FACTOR * median \
                    and duration >= SLOW_STEP_FLOOR_S:
                anomaly = "slow_step"
            if tracing and (anomaly or self._tracing.sampled(s.number)):
                self._trace(context or _context(s, duration), anomaly, loss)
        except Exception:
            self._errors.error("step")

    def _phases(self, s: Any, duration: float) -> dict[str, float] | None:
        """Host-clock phase seconds; on CUDA only the data wait (the rest comes from events)."""
        try:
            comm = self._comm()
            if self._device is not None:
                self._device.defer_step(DeviceStep(duration, s.phase_seconds["data"], s.device_phases,
                                                   comm.last_device_bucket()))
                phases = dict.fromkeys(PHASES, 0.0)
                phases["data"] = s.phase_seconds["data"]
                return phases
            phases = s.phase_seconds
            if s.backward_end:
                exposed = comm.exposed_wait(s.backward_start, s.backward_end, phases["backward"])
                phases["backward"] -= exposed
                phases["comm_wait"] += exposed
            phases["other"] += max(duration - sum(phases.values()), 0.0)
            return phases
        except Exception:
            self._errors.error("step")
            return None

    def _count(self, s: Any, duration: float, phases: dict[str, float] | None) -> None:
        dropped = False
        with self._lock:
            acc = self._acc
            acc.steps += 1
            if len(acc.durations) < MAX_PENDING_STEPS:
                acc.durations.append(duration)
            else:
                dropped = True
            if phases is not None:
                for k, v in phases.items():
                    acc.phase[k] += v
            acc.samples += s.samples
            acc.tokens += s.tokens
            acc.last_step = s.number
            acc.last_duration = duration
            acc.last_end = s.start_unix + duration
        self.steps_seen += 1
        if dropped:
            self._errors.drop("step_duration", f"more than {MAX_PENDING_STEPS} steps between two publishes")

    def _judge_values(self, s: Any, context: TraceContext | None) -> tuple[float | None, str]:
        loss = self._take("loss", s.loss, context)
        grad = self._take("grad_norm", s.grad_norm, context)
        lr = self._take("lr", s.lr, None)
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
        return loss, anomaly

    def _take(self, what: str, value: Any, context: TraceContext | None) -> float | None:
        """The value as a float now, or None (absent, deferred to the device, or dropped)."""
        if value is None:
            return None
        try:
            number = values.read(what, value)
        except values.NotANumber as e:
            self._errors.drop("value", str(e))
            return None
        if isinstance(number, float):
            return number
        if what == "lr":   # a device lr: rare, and not worth a deferred read
            return float(number.item())
        self._device.defer_value("loss" if what == "loss" else "grad", number, context)
        return None

    # -- judging (under the lock, every value exactly once) -----------------------
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
    def device_value_ready(self, value: DeviceValue) -> None:
        number = float(value.host)
        with self._lock:
            judge = self._judge_loss if value.what == "loss" else self._judge_grad
            anomaly = judge(number, self._acc)
        if anomaly and value.step is not None:
            # The loss is the primary signal; a grad anomaly is traced with no loss value.
            self._trace(value.step, anomaly, number if value.what == "loss" else None)

    def device_phases_ready(self, phases: dict[str, float]) -> None:
        with self._lock:
            for k, v in phases.items():
                self._acc.phase[k] += v

    # -- traces and the OOM path ---------------------------------------------------
    def _trace(self, c: TraceContext, anomaly: str, loss: float | None) -> None:
        base = c.start_unix - c.t0  # perf_counter -> unix seconds
        self._tracing.submit(StepRecord(
            step=c.number, start=c.start_unix, duration=c.duration,
            phases=[PhaseRecord(name, base + a, b - a) for name, a, b in c.phase_log],
            collectives=self._tracker.recent_since(c.start_unix),
            samples=c.samples, tokens=c.tokens, loss=loss, anomaly=anomaly,
        ))

    def _oom(self, s: Any, t1: float) -> None:
        try:
            with self._lock:
                self._acc.ooms += 1
            if self._tracing.enabled:
                self._trace(_context(s, t1 - s.t0), "oom", None)
            self._flush()
        except Exception:
            self._errors.error("step")


def _context(s: Any, duration: float) -> TraceContext:
    return TraceContext(s.number, s.start_unix, s.t0, duration, list(s.phase_log), s.samples, s.tokens)


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"
