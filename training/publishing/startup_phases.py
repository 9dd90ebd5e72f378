"""Where a rank is between its process start and its first step: its start-up phase.

A rank that never reaches ``init_process_group`` (stuck in its own start-up
code, or never launched) leaves its peers waiting inside it, in the store's
rendezvous, where no watchdog sees them. Each rank says which phase it is in
and since when (``rankscope_startup_phase``, ``..._since_timestamp_seconds``,
phases in ``contract.catalog.STARTUP_PHASES``) and how many ranks its launcher
started (``rankscope_launch_world_size``); the rules name the ranks that have
not reached the rendezvous their peers wait in, and count the ranks that never
reported (docs/alerting.md, RankscopeStartupBlocked).

The Monitor is usually made first (the adapters and the reference trainer make
it before ``init_process_group``): for its lifetime it puts a pass-through in
place of ``torch.distributed.init_process_group`` (``watch_init``) that notes
when the rank enters and leaves it; its arguments, result and exceptions are
torch's own. Code that bound ``init_process_group`` to a name of its own before
the Monitor existed is not seen entering it: its ranks read ``launch`` until
the process group exists, which pages nothing.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable


class StartupPhases:
    """The rank's phase (written by the training thread and the publisher; read by the publisher)."""

    def __init__(self, process_started_at: float, initialized: bool):
        self.phase = "first_step" if initialized else "launch"
        self.since = time.time() if initialized else process_started_at
        self._written: tuple[str, float] | None = None

    def enter(self, phase: str) -> None:
        if phase != self.phase:
            self.phase, self.since = phase, time.time()

    def write(self, metrics: Any, steps_seen: int) -> None:
        """Publisher thread: the phase's gauges, when it changed. A completed step ends start-up."""
        if steps_seen and self.phase != "training":
            self.enter("training")
        current = (self.phase, self.since)
        if current == self._written:
            return
        for phase, child in metrics.startup_phase.items():
            child.set(1.0 if phase == current[0] else 0.0)
        metrics.startup_since.set(current[1])
        self._written = current


def watch_init(phases: StartupPhases) -> Callable[[], None]:
    """Put the pass-through in place of ``init_process_group``; returns what undoes it."""
    from torch.distributed import distributed_c10d

    import torch.distributed as dist

    original = distributed_c10d.init_process_group

    # Named rankscope_<function> like every wrapper that runs a framework's own function in its place.
    @functools.wraps(original)
    def rankscope_init_process_group(*args: object, **kwargs: object) -> Any:
        phases.enter("rendezvous")
        result = original(*args, **kwargs)   # an exception is torch's, raised as it is (the rank fails)
        phases.enter("first_step")
        return result

    modules = (dist, distributed_c10d)
    for module in modules:
        module.init_process_group = rankscope_init_process_group

    def restore() -> None:
        for module in modules:
            if module.init_process_group is rankscope_init_process_group:
                module.init_process_group = original

    return restore

