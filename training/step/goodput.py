"""Where a rank process's wall time goes: goodput and badput, in seconds per category.

The categories (``catalog.GOODPUT_CATEGORIES``, after Google's
ml-goodput-measurement) split the time from the process's start to now with
no gap and no overlap, so they add up to the wall time (docs/goodput.md):

* ``startup``: process start to the first step;
* ``productive``: step time that trained, i.e. a step's duration minus its
  data wait and any checkpoint or evaluation inside it;
* ``data_wait``: waiting for batches;
* ``checkpoint_save`` / ``checkpoint_restore`` / ``evaluation``: inside
  ``monitor.checkpoint(...)`` / ``monitor.evaluation()``;
* ``lost_progress``: steps that an earlier launch of the same run had already
  completed (a relaunch from a checkpoint repeats them). Known only when the
  loop numbers its steps (``monitor.step(step=...)``; the framework adapters
  do): with the default counter every launch starts from 0;
* ``idle``: everything else, i.e. gaps between steps, steps cut short by an
  exception, time after the last step, and a hung step: one open longer than
  30 s and 10 times the running median step counts as idle from its start.

Time is attributed up to a moving ``mark``: a finished step, a finished
interval, or, at a publish, "now" unless a step, a batch fetch or an interval
is under way (that time is attributed when it ends), except a hung step,
whose time is idle as it passes.

Everything here runs on the publisher thread, from what the training thread
handed over (rankscope.step.handoff, worked out by rankscope.step.accounting).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from rankscope.contract.catalog import GOODPUT_CATEGORIES

PROGRESS_SUBDIR = "progress"   # <run>/progress/rank-<N>.json: the highest step the run's launches completed
HUNG_AFTER_S = 30.0          # a step open this long, and HUNG_FACTOR times the running median step,
HUNG_FACTOR = 10.0           # counts as idle (hung) from its start on


class TimeUse:
    """Seconds per category since the last ``take()``, attributed up to ``mark`` (perf_counter)."""

    def __init__(self, process_start: float, repeated_through: int):
        self.mark = process_start
        self.repeated_through = repeated_through   # steps numbered up to this were done by an earlier launch
        self.highest_step = repeated_through
        self.started = False
        self._seconds = dict.fromkeys(GOODPUT_CATEGORIES, 0.0)
        self._intervals: list[tuple[str, float, float]] = []   # ended, not yet placed

    def interval(self, category: str, t0: float, t1: float) -> None:
        """A checkpoint or evaluation block ran from ``t0`` to ``t1``."""
        self._intervals.append((category, t0, t1))

    def step(self, number: int, numbered: bool, t0: float, t1: float, data: float) -> None:
        """A completed step: ``data`` of its seconds waited for batches."""
        self._gap_until(t0)
        inside = self._place_intervals(t1)
        span = max(t1 - max(t0, self.mark), 0.0)   # a publish may have attributed its first instants
        data = min(data, span)
        repeated = numbered and number <= self.repeated_through
        self._seconds["data_wait"] += data
        self._seconds["lost_progress" if repeated else "productive"] += max(span - data - inside, 0.0)
        self.started = True
        self.mark = max(self.mark, t1)
        if numbered and number > self.highest_step:
            self.highest_step = number

    def failed_step(self, t0: float, t1: float) -> None:
        """A step cut short by an exception: its time trained nothing."""
        self._gap_until(t0)
        self._place_intervals(t1)
        self._seconds["idle"] += max(t1 - max(t0, self.mark), 0.0)
        self.started = True
        self.mark = max(self.mark, t1)

    def hung(self, step_since: float, now: float) -> None:
        """The step open since ``step_since`` has run far longer than steps do: its time so far is
        idle; if it ever ends, only what follows ``now`` counts as the step's."""
        self._gap_until(step_since)
        if now > self.mark:
            self._seconds["idle"] += now - self.mark
            self.mark = now

    def until(self, horizon: float) -> None:
        """Attribute the time up to ``horizon`` (nothing under way before it)."""
        self._gap_until(horizon)

    def settle(self, now: float, busy_since: float, open_step_since: float, median_step: float) -> None:
        """At a publish, once the steps that ended are placed: the time up to ``now`` is
        attributed, except what is under way since ``busy_since`` (a step, a batch fetch, a
        block: attributed when it ends), unless the open step is hung (0: nothing under way)."""
        if open_step_since and now - open_step_since > max(HUNG_AFTER_S, HUNG_FACTOR * median_step):
            self.hung(open_step_since, now)   # a hang, or waiting on a hung peer: idle, not productive
        else:
            self.until(min(busy_since, now) if busy_since else now)

    def take(self) -> dict[str, float]:
        """The seconds attributed since the last call, per category."""
        seconds, self._seconds = self._seconds, dict.fromkeys(GOODPUT_CATEGORIES, 0.0)
        return seconds

    def _gap_until(self, t: float) -> None:
        """Time from ``mark`` to ``t`` outside any step: intervals in it, the rest startup or idle."""
        if t <= self.mark:
            return
        used = self._place_intervals(t)
        self._seconds["idle" if self.started else "startup"] += max(t - self.mark - used, 0.0)
        self.mark = t

    def _place_intervals(self, t: float) -> float:
        """Count the intervals that ended by ``t`` into their categories; their seconds after ``mark``."""
        used = 0.0
        keep = []
        for category, a, b in self._intervals:
            if b > t:
                keep.append((category, a, b))
                continue
            seconds = max(b - max(a, self.mark), 0.0)
            self._seconds[category] += seconds
            used += seconds
        self._intervals = keep
        return used


def process_start_perf() -> float:
    """When this process started, on the ``perf_counter`` clock (import time where /proc is missing)."""
    try:
        stat = Path("/proc/self/stat").read_text()
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
        return time.perf_counter() - max(age, 0.0)
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED_AT


_IMPORTED_AT = time.perf_counter()


class Progress:
    """The highest step the run's launches completed on this rank, kept in the run directory,
    so that a relaunch knows which of its steps repeat earlier work."""

    def __init__(self, run_dir: Path, rank: int):
        self.path = run_dir / PROGRESS_SUBDIR / f"rank-{rank}.json"
        self.completed = self._load()   # -1: no earlier launch completed a numbered step

    def _load(self) -> int:
        try:
            return int(json.loads(self.path.read_text())["step"])
        except (OSError, ValueError, KeyError, TypeError):
            return -1

    def save(self, step: int) -> None:
        """Write ``step`` if it is higher than what is saved (atomically: a crash leaves the old value)."""
        if step <= self.completed:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"step": step}))
        os.replace(tmp, self.path)
        self.completed = step
