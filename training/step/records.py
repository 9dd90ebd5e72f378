"""What moves along the step path, as plain records.

* ``StepEnded``: a finished step, handed from the training thread
  (``rankscope.step.handoff``) to the publisher (``rankscope.step.accounting``);
* ``IntervalEnded``: a checkpoint or evaluation block, or a step an exception cut short;
* ``DeviceValueRead`` / ``DevicePhasesRead``: what the CUDA device finished for a step
  that ended earlier (its values, its phases), worked out in the same loop as the above;
* ``Overflow``: steps counted without their details while the publisher was far behind;
* ``TraceContext``: enough of a step to trace it later (a CUDA anomaly is known
  only once the device is done);

A traced step, as the tracer takes it, is the tracer's own record
(``rankscope.tracing.records``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence


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
    values: list                # as observed, in OBSERVED_VALUES' order (rankscope.step.observed); None when
                                # absent or deferred to the device
    versions: Sequence          # each tensor's version counter at the step's end, else None (a value
                                # declared versioned and modified later is dropped)
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


class DeviceValueRead(NamedTuple):
    """A CUDA observed value (``rankscope.step.observed``), read once the device was done with it."""

    what: str
    number: float
    step: TraceContext | None   # the step it belongs to, to trace it if it is an anomaly


class DevicePhasesRead(NamedTuple):
    """A CUDA step's seconds per phase, from its events, once the device was done with them."""

    phases: dict[str, float]


@dataclass
class Overflow:
    """Steps counted without their details, while the publisher was far behind."""

    steps: int = 0
    samples: int = 0
    tokens: int = 0
    last_step: int = -1
    last_duration: float = 0.0
    last_end: float = 0.0
