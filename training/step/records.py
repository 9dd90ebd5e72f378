"""What moves along the step path, as plain records.

* ``StepEnded``: a finished step, handed from the training thread
  (``rankscope.step.handoff``) to the publisher (``rankscope.step.accounting``);
* ``IntervalEnded``: a checkpoint or evaluation block, or a step an exception cut short;
* ``TraceContext``: enough of a step to trace it later (a CUDA anomaly is known
  only once the device is done);
* ``StepRecord`` / ``PhaseRecord``: a traced step as the tracer takes it
  (``rankscope.tracing``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from rankscope.collectives.tracker import CollectiveRecord


class StepEnded(NamedTuple):
    """A finished step, as the training thread hands it over: what it has, nothing read yet.

    The training thread builds a plain tuple in this layout (a tuple display is the cheapest
    thing Python builds, and right after a step every line runs cache-cold: docs/performance.md);
    the publisher reads it as a ``StepEnded`` (``StepEnded._make``)."""

    number: int
    numbered: bool              # the loop gave the number (step=...): a relaunch's repeats are known
    t0: float                   # perf_counter at the step's start (its first batch fetch's, if before it)
    t1: float                   # ... and at its end
    samples: int
    tokens: int
    data_unlogged: float        # seconds waited for batches beyond the phase log's bound
    phase_log: list             # (phase name, start, end) on perf_counter, in order
    exposed: float              # seconds of backward that only waited for communication (DDP strategies)
    loss: Any                   # as observed; None when absent or deferred to the device
    loss_version: int | None    # a tensor's version counter at the step's end: modified later, it is dropped
    grad_norm: Any
    grad_version: int | None
    lr: Any
    on_device: bool             # phases and values come from the CUDA device (rankscope.device.reads)


class IntervalEnded(NamedTuple):
    """A block of time that is not a completed step."""

    category: str               # checkpoint_save, checkpoint_restore, evaluation, or failed_step
    t0: float                   # perf_counter
    t1: float


@dataclass(slots=True)
class TraceContext:
    """Enough of a step to trace it later."""

    number: int
    start_unix: float
    t0: float
    duration: float
    phase_log: list[tuple[str, float, float]] = field(default_factory=list)
    samples: int = 0
    tokens: int = 0


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
