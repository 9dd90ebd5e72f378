"""The states the node exporter assigns a rank, one-hot in ``rankscope_rank_state{state}``, and
the groups of them every reader counts by (docs/design.md, "Rank states").

The exporter (``rankscope.exporter.ranks``) decides which state a rank is in; the readers
(``rankscope top``, ``rankscope report``, rank 0's TensorBoard / MLflow sink) only read the
series, and take the names and their order from here, never from the exporter.
"""

from __future__ import annotations

# In the order a reader lists them (``rankscope top``'s state counts).
RANK_STATES: tuple[str, ...] = (
    "starting",             # registered, no step completed yet, not stuck
    "progressing",          # steps complete
    "busy",                 # in a checkpoint or evaluation block it declared (monitor.checkpoint(), .evaluation())
    "stuck_in_collective",  # heartbeating, no step for a while, inside a collective
    "stuck",                # heartbeating, no step for a while, outside any collective
    "frozen",               # process alive, heartbeat stopped (SIGSTOP, GIL held in native code)
    "dead",                 # process gone without finishing, or its monitor ended on an exception
    "finished",             # the monitor was closed after the loop completed (no exception on the way)
)
# The states of a rank that is alive and not stepping: what a reader counts as stalled.
STALLED_STATES: tuple[str, ...] = ("stuck_in_collective", "stuck", "frozen")
# The states of a live process (starting up, stepping, or stalled).
LIVE_STATES: tuple[str, ...] = ("starting", "progressing", "busy") + STALLED_STATES
# The states of a rank process that has ended: it is in no collective and makes no progress.
ENDED_STATES: tuple[str, ...] = ("dead", "finished")
