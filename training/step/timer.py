"""Step and phase timing on the training thread: clocks and bookkeeping only.

``StepTimer`` owns the one reusable ``Step`` and the data wait between steps.
What a finished step means for the metrics (duration, phases, values,
anomalies) is ``accounting.StepAccounting``'s business; the timer hands it the
step when the step ends.

Data wait, in the loop shapes that real code has:

* one batch fetched before each step (the plain loop): the step starts when
  the fetch began, and the wait is its ``data`` phase;
* several batches fetched before one step (gradient accumulation with
  prefetched micro-batches): the step starts when the first of them began
  to be fetched; ``data`` is the sum of the waits;
* batches fetched inside the step (micro-batches drawn in the step): each
  wait is added to the open step's ``data`` phase.

So the durations of consecutive steps add up to the loop's wall time.
"""

from __future__ import annotations

import time
from time import perf_counter
from typing import Any, Callable

from rankscope.collectives.tracker import CollectiveTracker
from rankscope.contract.catalog import PHASES
from rankscope.errors import UsageError
from rankscope.step.observed import OBSERVED_VALUES
from rankscope.step.values import Observed
from rankscope.step.watched import Watched

MAX_PENDING_FETCHES = 10_000   # batches fetched before one step whose waits are logged one by one
_SLOTS = len(OBSERVED_VALUES)


class Phase:
    """Reusable timer for one phase of the current step (no allocation per use).

    It only appends ``(name, start, end)`` to the step's log: what the phases
    add up to is worked out off the training thread (rankscope.step.accounting).
    On a CUDA device it also records an event pair on the rank device's
    current stream: the host returns from forward long before the GPU finishes
    it, so device phases are measured by events and read later by the
    publisher. An event that fails to record is counted, never raised into the
    loop."""

    __slots__ = ("name", "step", "t0", "event", "token", "is_backward")

    def __init__(self, name: str, step: "Step"):
        self.name = name
        self.step = step
        self.t0 = 0.0
        self.event = None
        self.token = -1
        self.is_backward = name == "backward"

    def __enter__(self) -> "Phase":
        step = self.step
        if step.events is not None:
            try:
                event = step.events.get()
                event.record(step.stream)
                self.event = event
            except Exception:
                step.timer.on_error()
        if self.is_backward:
            # A rank blocked in backward may be waiting on its peers' all-reduce.
            op = step.timer.watched.comm.backward_in_flight
            if op is not None:
                self.token = step.timer.tracker.mark(op, time.time())
        self.t0 = perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        t1 = perf_counter()
        step = self.step
        step.phase_log.append((self.name, self.t0, t1))
        if self.is_backward:
            step.backward_start, step.backward_end = self.t0, t1
            if self.token >= 0:
                step.timer.tracker.unmark(self.token)
                self.token = -1
        if self.event is not None:
            try:
                end = step.events.get()
                end.record(step.stream)
                step.device_phases.append((self.name, self.event, end))
            except Exception:
                step.timer.on_error()
            self.event = None

    # Without a with-block, for code that only sees events (framework callbacks,
    # rankscope.integrations): ``start()`` where ``__enter__`` would run, ``stop()``
    # where ``__exit__`` would; each start needs its stop. The same functions, not
    # calls to them: a frame less on a path that runs cache-cold several times a step.
    start = __enter__
    stop = __exit__


class Step:
    """The step in progress: ``with monitor.step() as step``. Reused from step to step.

    Its log and values are handed over whole when it ends; ``begin`` gives the
    next step fresh ones, so nothing is copied on the training thread."""

    def __init__(self, timer: "StepTimer"):
        self.timer = timer
        self.events: Any = None      # the device's event pool while the step is open, if the rank is on CUDA
        self.stream: Any = None      # ...and the device's current stream when the step began
        self._phases = {name: Phase(name, self) for name in PHASES}
        self.open = False
        self.number = -1
        self.numbered = False        # the loop gave the step number (step=...), so a relaunch's repeats are known
        self.t0 = 0.0
        self.samples = 0
        self.tokens = 0
        self.data_unlogged = 0.0     # seconds waited for batches beyond the log's bound (in no log entry)
        self.phase_log: list[tuple[str, float, float]] = []
        self.device_phases: list[tuple[str, Any, Any]] = []
        self.backward_start = 0.0
        self.backward_end = 0.0
        self.values: list[Any] = [None] * _SLOTS   # what observe() got, one slot per value

    def phase(self, name: str) -> Phase:
        """Time a phase: ``data``, ``forward``, ``backward``, ``optimizer`` (or ``other``).
        A phase entered several times in a step (micro-batches) adds up."""
        try:
            return self._phases[name]
        except KeyError:
            raise ValueError(f"phase {name!r} is not one of {', '.join(PHASES)}") from None

    def observe(self, loss: Observed = None, grad_norm: Observed = None, lr: Observed = None) -> None:
        """Report the step's loss, gradient norm and learning rate (the last call wins).

        Floats and tensors are fine, and so are non-scalar values, reduced by
        the rules in ``rankscope.step.values`` (mean loss, total grad norm, first
        group's lr). A CPU tensor is read off the training thread, after the
        step; one modified in place before it is read is dropped and counted,
        never reported with its new value. A CUDA tensor is read once the
        device is done with it.
        """
        if not self.open:
            self.timer.on_drop("late_value", "step.observe() after its step ended")
            return
        values = self.values   # slots in OBSERVED_VALUES' order
        if loss is not None:
            values[0] = loss
        if grad_norm is not None:
            values[1] = grad_norm
        if lr is not None:
            values[2] = lr

    def count(self, samples: int = 0, tokens: int = 0) -> None:
        """Add samples and tokens to the open step (micro-batches counted as they arrive)."""
        self.samples += samples
        self.tokens += tokens

    def __enter__(self) -> "Step":
        self.timer.begin(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.timer.end(self, exc)
        return False  # never swallow the loop's exception

    # Without a with-block, for code that only sees events (framework callbacks,
    # rankscope.integrations): ``monitor.step().begin()`` ... ``step.end()``. ``begin`` starts
    # the step as entering ``with monitor.step()`` does (the same function: a frame less).
    begin = __enter__

    def end(self, exc: BaseException | None = None) -> None:
        """End the step begun by ``begin()``. ``exc``: the exception that cut it short; such a
        step is not counted as completed, and an out-of-memory error is counted as one."""
        if self.open:
            self.timer.end(self, exc)


class StepTimer:
    """Starts and ends steps, and keeps the data wait between them."""

    def __init__(self, tracker: CollectiveTracker, watched: Watched,
                 on_end: Callable[[Step, float, BaseException | None], None],
                 on_drop: Callable[[str, str], None], on_error: Callable[[], None] = lambda: None):
        self.tracker = tracker
        self.device = tracker.device         # device.RankDevice: CUDA once known
        self.watched = watched               # the comm timing (DDP's wait in backward), as watch() left it
        self.on_drop = on_drop
        self.on_error = on_error
        self._on_end = on_end
        self.step = Step(self)
        self._next_number = 0
        self._pending_start = 0.0            # perf_counter when the first fetch since the last step began
        self._pending_unlogged = 0.0         # waits beyond MAX_PENDING_FETCHES, in no log entry
        self._pending_log: list[tuple[str, float, float]] = []
        self.fetch_started = 0.0             # perf_counter when the batch being fetched now was asked for
        self.block_started = 0.0             # perf_counter when the open checkpoint or evaluation block began
        # Framework-driven loops (rankscope.integrations): the time since the framework's last
        # event, which the next event tells apart (a data wait, a save, its own work).
        self.settling_since = 0.0

    def busy_since(self) -> float:
        """Since when (perf_counter) the loop is inside a step, a batch fetch or a block; 0 if it is not.
        Read by the publisher thread: time before this point is settled, time after it is not."""
        s = self.step
        candidates = [t for t in (s.t0 if s.open else 0.0, self._pending_start, self.fetch_started,
                                  self.block_started, self.settling_since) if t]
        return min(candidates) if candidates else 0.0

    def open_step_since(self) -> float:
        """When (perf_counter) the step now open began; 0 if none is open. Read by the publisher."""
        s = self.step
        return s.t0 if s.open else 0.0

    def settle(self) -> None:
        """The loop is over (the monitor closes): nothing is under way any more."""
        self.fetch_started = self.block_started = self.settling_since = 0.0

    def arm(self, samples: int, tokens: int, number: int | None) -> Step:
        s = self.step
        if s.open:
            raise _nested(s)
        s.samples, s.tokens = samples, tokens
        if number is None:
            s.number, s.numbered = self._next_number, False
        else:
            s.number, s.numbered = number, True
        return s

    def data_fetched(self, t0: float, t1: float) -> None:
        """A batch took from ``t0`` to ``t1`` (perf_counter) to arrive."""
        self.fetch_started = 0.0
        s = self.step
        if s.open:
            s.phase_log.append(("data", t0, t1))
            return
        if not self._pending_start:
            self._pending_start = t0
        if len(self._pending_log) < MAX_PENDING_FETCHES:
            self._pending_log.append(("data", t0, t1))
        else:   # a loop that fetches without stepping: the wait still counts, its log entry does not
            self._pending_unlogged += t1 - t0
            self.on_drop("data_wait", f"more than {MAX_PENDING_FETCHES} batches fetched between two steps")

    def begin(self, s: Step) -> None:
        if s.open:
            raise _nested(s)
        s.open = True
        self._next_number = s.number + 1
        s.values = [None] * _SLOTS   # the last step's list went with it to the publisher
        s.backward_end = 0.0
        if self._pending_start:
            s.t0 = self._pending_start
            s.data_unlogged = self._pending_unlogged
            s.phase_log = self._pending_log
            self._pending_start = self._pending_unlogged = 0.0
            self._pending_log = []
        else:
            s.t0 = perf_counter()
            s.data_unlogged = 0.0
            s.phase_log = []
        if s.device_phases:
            s.device_phases = []
        device = self.device
        if device.unresolved:   # Monitor(device="cuda"): the loop has set its device by now
            try:
                device.bind_current()
            except Exception:
                self.on_error()
        events = s.events = device.events
        if events is not None:
            s.stream = device.stream()
        comm = self.watched.comm
        if comm.mode != "off":
            comm.step_started()

    def end(self, s: Step, exc: BaseException | None) -> None:
        t1 = perf_counter()
        s.open = False
        self._on_end(s, t1, exc)


def _nested(s: Step) -> UsageError:
    return UsageError(f"monitor.step() inside step {s.number}, which is still open: steps do not nest "
                      "(for micro-batches, use one step and enter its phases several times)")
