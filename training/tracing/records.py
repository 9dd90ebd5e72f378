"""A traced step as the tracer takes it (built by ``rankscope.step.trace_feed`` only for the steps
it samples or finds anomalous). The tracer's own records: the step path imports them, never the
reverse."""

from __future__ import annotations

from dataclasses import dataclass, field

from rankscope.collectives.tracker import CollectiveRecord


@dataclass(slots=True)
class PhaseRecord:
    name: str
    start: float      # unix seconds
    duration: float   # seconds


@dataclass(slots=True)
class StepRecord:
    """One completed step, as the tracer needs it (built only for traced steps)."""

    step: int
    start: float                     # unix seconds
    duration: float                  # seconds
    phases: list[PhaseRecord] = field(default_factory=list)
    collectives: list[CollectiveRecord] = field(default_factory=list)
    samples: int = 0
    tokens: int = 0
    loss: float | None = None
    anomaly: str = ""                # "", "loss_spike", "nonfinite_loss", "nonfinite_grad", "grad_spike", "slow_step", "oom"
