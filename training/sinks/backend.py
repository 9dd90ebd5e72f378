"""What a backend is to the sink, and the thread and bounded queue each one writes from.

A record that does not fit in the queue, or that its backend fails to write (a dead MLflow
server, a full disk), is dropped and counted in ``rankscope_telemetry_dropped_total{what="sink"}``.
"""

from __future__ import annotations

import importlib.util
import queue
import threading
from typing import Callable

from rankscope.sinks.summary import Record

# How far a backend may fall behind before records are dropped (and counted): two minutes of records,
# at least 8. MLflow's import and a new sqlite store's schema take ~2.5 s of CPU on the writer thread,
# over 8 s on a node whose cores the ranks keep busy: at a 1 s interval, 8 records were too few.
QUEUE_SECONDS = 120.0
QUEUE_MIN_RECORDS = 8


def missing(module: str) -> bool:
    """Whether an optional package is not installed (checked at start-up, imported only when used)."""
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


class Backend:
    name = "backend"
    reopen_after_error = False

    def open(self) -> None:
        raise NotImplementedError

    def write(self, record: Record) -> None:
        raise NotImplementedError

    def close(self) -> int:
        """Finish; returns the records found lost on the way (counted as drops)."""
        return 0

    def reset(self) -> None:
        """After a failed write: let the next record open the backend afresh."""


class Writer:
    """One backend's thread and bounded queue."""

    def __init__(self, backend: Backend, drop: Callable[..., None], records: int = QUEUE_MIN_RECORDS):
        self.backend = backend
        self.drop = drop
        self.queue: queue.Queue[Record] = queue.Queue(maxsize=records)
        self.closing = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"rankscope-sink-{backend.name}", daemon=True)
        self.opened = False

    def offer(self, record: Record) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.drop("sink", f"the {self.backend.name} writer is {self.queue.maxsize} records behind")

    def _run(self) -> None:
        while True:
            try:
                record = self.queue.get(timeout=0.2)
            except queue.Empty:
                if self.closing.is_set():
                    break
                continue
            try:
                if not self.opened:
                    self.backend.open()
                    self.opened = True
                self.backend.write(record)
            except Exception as e:   # noqa: BLE001 - a dead server, a full disk: the record is lost
                self.drop("sink", f"{self.backend.name}: {type(e).__name__}: {str(e)[:200]}")
                if self.opened and self.backend.reopen_after_error:
                    self.backend.reset()
                    self.opened = False
            failed = getattr(self.backend, "take_failed", lambda: 0)()
            if failed:
                self.drop("sink", f"{self.backend.name}: an asynchronous batch failed", n=failed)
        try:
            lost = self.backend.close() if self.opened else 0
        except Exception as e:   # noqa: BLE001
            lost = 0
            self.drop("sink", f"{self.backend.name}: closing failed: {type(e).__name__}: {str(e)[:200]}")
        if lost:
            self.drop("sink", f"{self.backend.name}: an asynchronous batch failed", n=lost)
