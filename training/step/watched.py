"""What ``Monitor.watch()`` attached to the loop's model, for the step path to use.

One holder, made with the Monitor and handed at construction to each part that
reads it (the timer, the handoff, the accounting, the publisher): ``watch()``
fills it, and nobody reaches through another part to find it.

* ``comm``: how DDP's wait in backward is known (``rankscope.collectives.comm_timing``:
  off until a DDP model is watched);
* ``replica_check``: the fingerprints of what the model replicates
  (``rankscope.replicas.check``), or None.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rankscope.collectives.comm_timing import CommTiming

if TYPE_CHECKING:
    from rankscope.replicas.check import ReplicaCheck


class Watched:
    __slots__ = ("comm", "replica_check")

    def __init__(self) -> None:
        self.comm: CommTiming = CommTiming()
        self.replica_check: ReplicaCheck | None = None

    def use_comm_timing(self, comm: CommTiming) -> None:
        """A DDP model was watched: its all-reduces are timed this way from the next step on."""
        self.comm = comm

    def check_replicas(self, check: ReplicaCheck) -> None:
        self.replica_check = check
