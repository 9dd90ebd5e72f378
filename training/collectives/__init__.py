"""Collectives: what the rank times itself, and what torch's flight recorders say of the rest.

* ``tracker``: ``CollectiveTracker``, the collectives in flight and the completed ones
  (host clock on gloo, CUDA events on NCCL);
* ``comm_timing``: how a DDP model's gradient all-reduces are timed (hook, reducer, off);
* ``group_reader``: every collective of every process group, from the flight recorders, read by
  ``ProcessGroupReader`` with ``ring_source`` (the recorders' reads), ``ring_entries`` (each entry
  counted once), ``group_table`` (the groups' labels, budget, publishing), ``group_metrics`` (their
  series) and ``protocols`` (what the reader needs of them); ``process_groups`` re-exports them;
* ``flight_recorder``: the recorders' ring size, and their dumps when a collective hangs.
"""

from rankscope.collectives.tracker import CollectiveRecord, CollectiveTracker

__all__ = ["CollectiveRecord", "CollectiveTracker"]
