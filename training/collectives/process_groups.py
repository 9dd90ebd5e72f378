"""Every collective of every process group, from torch's flight recorders: the names this
module held before it was split, re-exported from their homes so that existing imports keep
working.

* ``group_reader``: ``ProcessGroupReader``, the thread that reads the recorders when due (the
  whole design is in its docstring);
* ``ring_source``: ``FlightRecorderSource``, the recorders' two reads (status; the ring as
  JSON from torch's worker server), and which recorders a torch build has;
* ``ring_entries``: what an entry says (``op_of``, ``entry_nbytes``), ``Cursor`` and
  ``EntryCounter``, each entry counted once;
* ``group_table``: ``Group``, ``group_label`` and ``GroupTable``, the groups' labels, budget
  and publishing;
* ``group_metrics``: ``ProcessGroupMetrics``, the series on the rank's metrics;
* ``protocols``: what the reader needs from its source and its metrics.
"""

from rankscope.collectives.group_metrics import ProcessGroupMetrics
from rankscope.collectives.group_reader import (DEFAULT_PG_ID, ENTRIES_AT_MOST_EVERY_S, ENTRIES_EVERY_S,
                                                READ_BUDGET, RING_SHARE, ProcessGroupReader)
from rankscope.collectives.group_table import MAX_LABEL, Group, GroupTable, group_label
from rankscope.collectives.protocols import ProcessGroupSink, RingSource
from rankscope.collectives.ring_entries import GIL_SLICE_S, MAX_IN_FLIGHT, Cursor, EntryCounter, entry_nbytes, op_of
from rankscope.collectives.ring_source import (RECORDERS, FlightRecorderSource, available_recorders,
                                               recorder_holds_cuda_events)

__all__ = [
    "DEFAULT_PG_ID", "ENTRIES_AT_MOST_EVERY_S", "ENTRIES_EVERY_S", "GIL_SLICE_S", "MAX_IN_FLIGHT", "MAX_LABEL",
    "READ_BUDGET", "RECORDERS", "RING_SHARE", "Cursor", "EntryCounter", "FlightRecorderSource", "Group",
    "GroupTable", "ProcessGroupMetrics", "ProcessGroupReader", "ProcessGroupSink", "RingSource",
    "available_recorders", "entry_nbytes", "group_label", "op_of", "recorder_holds_cuda_events",
]
