"""How long a background thread runs Python between two points where it lets the GIL go.

The training thread must never wait long for the GIL. A thread that does not
give it up itself keeps it for Python's switch interval (5 ms) once the
training thread asks for it, so each background thread works in short
stretches and records the longest (docs/performance.md, "GIL holds"). Wall
time bounds the hold from above; the thread's own CPU time says how much of
it was work rather than waiting for the GIL or the kernel.
"""

from __future__ import annotations

from time import perf_counter, thread_time


class LongestHold:
    """The longest stretch measured with ``start()`` ... ``stop()``, in wall and own-CPU seconds."""

    __slots__ = ("wall_s", "cpu_s", "_t0", "_c0")

    def __init__(self) -> None:
        self.wall_s = 0.0
        self.cpu_s = 0.0
        self._t0 = 0.0
        self._c0 = 0.0

    def start(self) -> None:
        self._t0, self._c0 = perf_counter(), thread_time()

    def stop(self) -> None:
        wall, cpu = perf_counter() - self._t0, thread_time() - self._c0
        if wall > self.wall_s:
            self.wall_s = wall
        if cpu > self.cpu_s:
            self.cpu_s = cpu

    def as_dict(self) -> dict[str, float]:
        return {"longest_wall_ms": 1e3 * self.wall_s, "longest_cpu_ms": 1e3 * self.cpu_s}
