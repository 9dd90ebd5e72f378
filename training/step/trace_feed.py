"""Which steps become traces, and the record each one becomes.

A step is traced when its number is sampled (the same numbers on every rank,
so their spans form one trace) or when it is anomalous (a non-finite or spiking
value, a slow step, an out-of-memory error). The record carries the step's
phases and the collectives that started within it.
"""

from __future__ import annotations

import time
from typing import Any

from rankscope.collectives.tracker import CollectiveTracker
from rankscope.step.records import TraceContext
from rankscope.tracing.api import Tracing
from rankscope.tracing.records import PhaseRecord, StepRecord


class TraceFeed:
    def __init__(self, tracing: Tracing, tracker: CollectiveTracker):
        self._tracing = tracing
        self._tracker = tracker

    @property
    def enabled(self) -> bool:
        return self._tracing.enabled

    def context_of(self, step: Any, duration: float) -> TraceContext:
        """A step's context, taken on the training thread as it ends (a ``step.timer.Step``)."""
        start_unix = time.time() - (time.perf_counter() - step.t0)
        return TraceContext(step.number, start_unix, step.t0, duration, step.phase_log, step.samples, step.tokens)

    def step(self, context: TraceContext, anomaly: str, loss: float | None) -> None:
        """A step judged on the publisher: traced if it is anomalous or its number is sampled."""
        if self._tracing.enabled and (anomaly or self._tracing.sampled(context.number)):
            self.submit(context, anomaly, loss)

    def submit(self, c: TraceContext, anomaly: str, loss: float | None) -> None:
        base = c.start_unix - c.t0  # perf_counter -> unix seconds
        end = c.start_unix + c.duration
        self._tracing.submit(StepRecord(
            step=c.number, start=c.start_unix, duration=c.duration,
            phases=[PhaseRecord(name, base + a, b - a) for name, a, b in c.phase_log],
            collectives=self._tracker.recent_between(c.start_unix, end),
            samples=c.samples, tokens=c.tokens, loss=loss, anomaly=anomaly,
        ))
