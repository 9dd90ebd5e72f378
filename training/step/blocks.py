"""Checkpoint and evaluation blocks: time the loop spends neither stepping nor idle.

A block's seconds go to goodput as its own category (``rankscope_wall_seconds_total``),
never to the step it interrupts or to idle time. While one is open, the rank's
files say so (``rankscope_block_started_timestamp_seconds``), so that a long
save is not taken for a hang (docs/alerting.md).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

from rankscope.errors import TelemetryErrors, UsageError
from rankscope.publishing.metrics import RankMetrics
from rankscope.step.handoff import StepHandoff
from rankscope.step.timer import StepTimer

CHECKPOINT_KINDS = ("save", "restore")


class Blocks:
    def __init__(self, timer: StepTimer, handoff: StepHandoff, metrics: RankMetrics, errors: TelemetryErrors):
        self._timer = timer
        self._handoff = handoff
        self._metrics = metrics
        self._errors = errors

    @contextmanager
    def block(self, category: str) -> Iterator[None]:
        """``category``: ``checkpoint_save``, ``checkpoint_restore`` or ``evaluation``."""
        timer = self._timer
        if timer.block_started:
            raise UsageError(f"monitor.{category.split('_')[0]}() inside another checkpoint or evaluation block: "
                             "blocks do not nest")
        t0 = timer.block_started = time.perf_counter()
        # Written here, not by the publisher: a save that holds the GIL from its first
        # instruction (a large pickle) would keep the publisher from saying so until it ends.
        # One mmap write each way, at the block's edges only.
        self._mark(category, time.time())
        try:
            yield
        finally:
            self._mark(category, 0.0, ended=time.time())
            timer.block_started = 0.0
            self._handoff.interval_ended(category, t0, time.perf_counter())

    def took(self, category: str, t0: float, t1: float) -> None:
        """A block that ran from ``t0`` to ``t1`` (perf_counter), learnt afterwards (framework callbacks)."""
        self._handoff.interval_ended(category, t0, t1)

    def _mark(self, category: str, started: float, ended: float = 0.0) -> None:
        try:
            if ended:   # first: the block's end is progress before the block is gone from the files
                self._metrics.block_ended.set(ended)
            self._metrics.block_started[category].set(started)
        except Exception:   # a closed monitor's files: counted, never raised into the job
            self._errors.error("publisher")


def checkpoint_category(kind: str, where: str) -> str:
    if kind not in CHECKPOINT_KINDS:
        raise ValueError(f"monitor.{where}({kind!r}): kind is 'save' or 'restore'")
    return "checkpoint_" + kind
