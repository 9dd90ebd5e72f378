"""Monitor steps driven by a framework's events instead of a ``with monitor.step():`` block.

A framework calls its callbacks at points of its own loop; ``EventSteps``
turns those points into the same step, phases and values a hand-written
loop reports:

* between two steps the framework first does its own work (logging,
  evaluation, a checkpoint), then fetches the next batch. The adapters mark
  the end of that work (``between_steps()``, on the framework's log, save
  and evaluate events); the next step starts there, and the rest of the gap
  becomes its ``data`` phase, as ``monitor.data()`` would have measured it.
  Time the framework spends on its own work is outside every step, as it is
  in the reference trainer;
* ``switch(phase)`` closes the running phase and opens the next one;
  time in no phase is the step's ``other``;
* per-micro-batch losses are added up (each is already divided by the
  accumulation count, so the sum is the step's loss) and observed with the
  gradient norm and learning rate when the step ends.

Nothing here raises into the training loop: an error is counted in
``rankscope_telemetry_errors_total{component="step"}`` and logged once by the
caller (``guarded``).
"""

from __future__ import annotations

import functools
import time
import weakref
from typing import Any, Callable, TypeVar

from rankscope.contract.environment import ConfigError

F = TypeVar("F", bound=Callable[..., Any])

CHECKPOINT_SECONDS = "checkpoint_save_seconds"   # rankscope_user_checkpoint_save_seconds_{count,sum,bucket}


class EventSteps:
    """One rank's open step and phase, moved along by framework events (training thread only)."""

    def __init__(self, monitor: Any):
        self.monitor = monitor
        self.step: Any = None          # rankscope.step.timer.Step while a step is open
        self.phase: Any = None         # the running rankscope.step.timer.Phase, or None
        self.idle_since = time.perf_counter()
        self.loss: Any = None
        self.grad_norm: Any = None
        self.lr: Any = None
        self.saving_since = 0.0        # perf_counter at a checkpoint save's start whose end no event marks yet
        self.evaluating_since = 0.0    # perf_counter at an evaluation's start, while it runs
        self.saves = _save_histogram(monitor)

    @property
    def open(self) -> bool:
        return self.step is not None

    def between_steps(self) -> None:
        """The framework finished work of its own between steps (a log, an evaluation, a save)."""
        if self.step is None:
            self.idle_since = time.perf_counter()
            if self.saving_since:
                self.saves.observe(self.idle_since - self.saving_since)
                self.monitor.checkpoint_took(self.saving_since, self.idle_since)
                self.saving_since = 0.0
            self.monitor.awaiting_next_event(self.idle_since)

    def begin(self, number: int | None = None) -> None:
        """Start a step; the time since the framework's last own work is its data wait."""
        if self.step is not None:
            # The framework skipped the event that ends a step (a failure it swallowed): the
            # step did not complete, so it is not counted.
            self.end(exc=RuntimeError("the framework started a new step before the last one ended"))
        if self.evaluating_since:   # an evaluation whose end no event marked
            self.evaluation_ended()
        if self.saving_since:
            # A save whose end no event marked: its time and the batch fetch after it are not
            # told apart, and the save takes both (a checkpoint is never counted as data wait).
            self.between_steps()
        now = time.perf_counter()
        self.monitor.waited_for_data(self.idle_since, now)
        self.monitor.awaiting_next_event(0.0)
        self.loss = self.grad_norm = self.lr = None
        self.step = self.monitor.step(step=number).begin()

    def waited_for_data(self, since: float) -> None:
        """Inside a step: a micro-batch took from ``since`` until now to arrive."""
        self.monitor.waited_for_data(since, time.perf_counter())

    def switch(self, name: str | None) -> None:
        """Close the running phase and open ``name`` (None: none, the time counts as ``other``)."""
        self.phase = switch_phase(self.step, self.phase, name)

    @property
    def phase_name(self) -> str | None:
        return self.phase.name if self.phase is not None else None

    def add_loss(self, loss: Any) -> None:
        """A micro-batch's loss, as the framework returned it (detached; already divided by the
        number of accumulated micro-batches, so the step's loss is the sum)."""
        if loss is not None and self.step is not None:
            self.loss = loss if self.loss is None else self.loss + loss

    def end(self, exc: BaseException | None = None) -> None:
        """End the open step; ``exc``: the exception that cut it short (an OOM is counted)."""
        step = self.step
        if step is None:
            return
        self.switch(None)
        self.step = None
        try:
            if exc is None:
                step.observe(loss=self.loss, grad_norm=self.grad_norm, lr=self.lr)
        finally:
            self.loss = self.grad_norm = self.lr = None
            step.end(exc)
            self.idle_since = time.perf_counter()
            self.monitor.awaiting_next_event(self.idle_since)

    def checkpoint_saved(self, started: float) -> None:
        """The framework has just finished a checkpoint save that began at ``started`` (perf_counter)."""
        if self.step is None:
            now = time.perf_counter()
            self.saves.observe(now - started)
            self.monitor.checkpoint_took(started, now)
            self.between_steps()

    def checkpoint_saving(self) -> None:
        """The framework begins a checkpoint save; its end is the next event (an evaluation's start,
        the next step's start, or the end of training). A save during an evaluation ends it."""
        if self.evaluating_since:
            self.evaluation_ended()
        if self.step is None and not self.saving_since:
            self.saving_since = time.perf_counter()

    def evaluation_started(self) -> None:
        """The framework begins an evaluation between steps: a save before it has ended."""
        if self.step is None and not self.evaluating_since:
            self.between_steps()
            self.evaluating_since = time.perf_counter()

    def evaluation_ended(self) -> None:
        """The evaluation is over (or a save inside it began): its seconds are ``evaluation``."""
        if self.evaluating_since:
            self.monitor.evaluation_took(self.evaluating_since, time.perf_counter())
            self.evaluating_since = 0.0
        self.between_steps()


_save_histograms: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def _save_histogram(monitor: Any) -> Any:
    """The checkpoint-save histogram of a monitor, declared once however many runs or callbacks use it."""
    histogram = _save_histograms.get(monitor)
    if histogram is None:
        histogram = monitor.histogram(CHECKPOINT_SECONDS, "Checkpoint saves by the training framework and the "
                                      "seconds each took, between steps (rankscope.integrations).")
        _save_histograms[monitor] = histogram
    return histogram


def switch_phase(step: Any, running: Any, name: str | None) -> Any:
    """Stop the ``running`` phase (if any) and start ``name`` in the open ``step`` (None: none, the
    time counts as ``other``); returns the phase running now."""
    if running is not None:
        running.stop()
    if name is not None and step is not None:
        return step.phase(name).start()
    return None


def guarded(method: F) -> F:
    """A callback method that never raises into the framework's loop: an error is counted
    (``rankscope_telemetry_errors_total{component="step"}``) and logged once. A
    ``ConfigError`` (a mistake at start-up, such as a model DDP timing cannot read) is raised."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except ConfigError:
            raise
        except Exception:
            monitor = getattr(self, "monitor", None)
            if monitor is not None:
                monitor.errors.error("step")
            return None

    return call  # type: ignore[return-value]


def first_lr(optimizer: Any) -> Any:
    """The learning rate of the optimizer's first parameter group, or None."""
    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        return None
    return groups[0].get("lr")


def batch_size(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (a dict's, a list's or itself)."""
    if isinstance(batch, dict):
        batch = next(iter(batch.values()), None)
    elif isinstance(batch, (list, tuple)):
        batch = batch[0] if batch else None
    shape = getattr(batch, "shape", None)
    return int(shape[0]) if shape else 0
