"""Judging each step inside the rank: exact, every step, pure Python (publisher thread).

Prometheus sees one loss value per scrape; a NaN or a one-step spike between
two scrapes would be lost. So every loss and gradient norm the rank reports
goes through these trackers, in order, exactly once, and what they find is
counted. A step far slower than the running median is an anomaly too (it is
traced).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

SLOW_STEP_FACTOR = 3.0       # a step this many times the running median is traced as an anomaly
SLOW_STEP_FLOOR_S = 0.001    # ...if it took at least this long: µs-scale steps jitter by more than 3x


@dataclass(frozen=True)
class JudgeSettings:
    loss_window: int
    loss_ema_alpha: float
    spike_zscore: float
    spike_warmup_steps: int
    grad_spike_factor: float


@dataclass
class LossVerdict:
    nonfinite: bool = False
    spike: bool = False
    zscore: float = 0.0
    ema: float = math.nan


class LossTracker:
    """Rolling mean and deviation of the loss over the last ``window`` finite values.

    A loss is a spike when it lies more than ``spike_z`` deviations above the
    rolling mean of the losses before it, once ``warmup`` values are known.
    Non-finite values are counted and kept out of the statistics, so one NaN
    does not poison the window.
    """

    def __init__(self, window: int, ema_alpha: float, spike_z: float, warmup: int):
        self.window: deque[float] = deque(maxlen=window)
        self.ema_alpha = ema_alpha
        self.spike_z = spike_z
        self.warmup = max(warmup, 2)
        self.ema = math.nan
        self._sum = 0.0
        self._sumsq = 0.0
        self._appended = 0

    def observe(self, loss: float) -> LossVerdict:
        if not math.isfinite(loss):
            return LossVerdict(nonfinite=True, ema=self.ema)
        verdict = LossVerdict()
        n = len(self.window)
        if n >= 2:
            mean = self._sum / n
            var = max(self._sumsq / n - mean * mean, 0.0)
            # A floor on the deviation keeps a perfectly flat loss from
            # turning float noise into huge z-scores.
            std = max(math.sqrt(var), 1e-6 * max(abs(mean), 1e-12))
            verdict.zscore = (loss - mean) / std
            verdict.spike = n >= self.warmup and verdict.zscore > self.spike_z
        if n == self.window.maxlen:
            old = self.window[0]
            self._sum -= old
            self._sumsq -= old * old
        self.window.append(loss)
        self._sum += loss
        self._sumsq += loss * loss
        self._appended += 1
        if self._appended % self.window.maxlen == 0:  # shed float drift of the running sums
            self._sum = math.fsum(self.window)
            self._sumsq = math.fsum(x * x for x in self.window)
        self.ema = loss if math.isnan(self.ema) else self.ema + self.ema_alpha * (loss - self.ema)
        verdict.ema = self.ema
        return verdict


class GradNormTracker:
    """Flags a gradient norm that is ``factor`` times its moving average."""

    def __init__(self, factor: float, alpha: float = 0.05, warmup: int = 10):
        self.factor = factor
        self.alpha = alpha
        self.warmup = warmup
        self.avg = math.nan
        self.seen = 0

    def observe(self, norm: float) -> tuple[bool, bool]:
        """Returns (nonfinite, explosion)."""
        if not math.isfinite(norm):
            return True, False
        explosion = self.seen >= self.warmup and norm > self.factor * self.avg
        self.seen += 1
        if not explosion:  # an explosion must not drag the average up with it
            self.avg = norm if math.isnan(self.avg) else self.avg + self.alpha * (norm - self.avg)
        return False, explosion


class Verdict(NamedTuple):
    """The verdict on one value: its anomaly ("" for none) and, for a finite loss, the loss's
    moving average and z-score after it. The accounting applies it (``rankscope.step.accounting``)."""

    anomaly: str = ""    # "", "nonfinite_loss", "loss_spike", "nonfinite_grad", "grad_spike"
    ema: float = math.nan
    zscore: float = math.nan


FINE = Verdict()


class Judge:
    """The verdict on each value and step; it writes nothing but its own running statistics."""

    def __init__(self, settings: JudgeSettings):
        self._loss = LossTracker(settings.loss_window, settings.loss_ema_alpha, settings.spike_zscore,
                                 settings.spike_warmup_steps)
        self._grad = GradNormTracker(settings.grad_spike_factor)
        self.median_step = 0.0   # a running median-like estimate of the step's duration (seconds)

    def loss(self, loss: float) -> Verdict:
        verdict = self._loss.observe(loss)
        if verdict.nonfinite:
            return Verdict("nonfinite_loss")
        return Verdict("loss_spike" if verdict.spike else "", verdict.ema, verdict.zscore)

    def grad_norm(self, norm: float) -> Verdict:
        nonfinite, explosion = self._grad.observe(norm)
        if nonfinite:
            return Verdict("nonfinite_grad")
        return Verdict("grad_spike") if explosion else FINE

    def slow_step(self, number: int, duration: float) -> bool:
        """Whether the step took far longer than usual; the running estimate learns it either way."""
        median = self.median_step
        self.median_step = duration if not median else median + 0.05 * (duration - median)
        return bool(median) and number > 10 and duration > SLOW_STEP_FACTOR * median \
            and duration >= SLOW_STEP_FLOOR_S
