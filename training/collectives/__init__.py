"""Collectives: what the rank times itself, and what torch's flight recorders say of the rest.

* ``tracker``: ``CollectiveTracker``, the collectives in flight and the completed ones
  (host clock on gloo, CUDA events on NCCL);
* ``comm_timing``: how a DDP model's gradient all-reduces are timed (hook, reducer, off);
* ``process_groups``: every collective of every process group, from the flight recorders;
* ``flight_recorder``: the recorders' ring size, and their dumps when a collective hangs.
"""

from rankscope.collectives.tracker import CollectiveRecord, CollectiveTracker

__all__ = ["CollectiveRecord", "CollectiveTracker"]
