"""rankscope.collectives.ring_entries without a job: op names, message sizes, and each entry of
flight-recorder JSON as torch 2.13 writes it counted once (incremental reads, entries lost to
the ring, durations written late, one cursor per recorder).
The same reader against a real recorder is tested in test_collectives_process_groups.py."""

from __future__ import annotations

import pytest

from rankscope.contract.catalog import PROCESS_GROUP_OPS
from rankscope.collectives.group_reader import ProcessGroupReader
from rankscope.collectives.ring_entries import entry_nbytes, op_of
from tests.unit.collectives.fakes import FakeRecorder, Sink, Source, make


@pytest.mark.parametrize("name, op", [
    ("gloo:all_reduce", "all_reduce"), ("nccl:all_reduce", "all_reduce"), ("nccl:allreduce_coalesced", "all_reduce"),
    ("gloo:all_gather", "all_gather"), ("nccl:_allgather_base", "all_gather"),
    ("nccl:all_gather_into_tensor_coalesced", "all_gather"), ("nccl:_reduce_scatter_base", "reduce_scatter"),
    ("nccl:reduce_scatter_tensor_coalesced", "reduce_scatter"), ("gloo:broadcast", "broadcast"),
    ("gloo:barrier", "barrier"), ("nccl:all_to_all", "all_to_all"), ("nccl:alltoall_base", "all_to_all"),
    ("nccl:send 0->1", "send"), ("nccl:recv 1<-0", "recv"), ("gloo:reduce", "reduce"), ("gloo:gather", "gather"),
    ("gloo:scatter", "scatter"), ("gloo:monitored_barrier", "other"), ("", "other"),
])
def test_op_names_map_to_the_catalog(name, op):
    assert op_of(name) == op and op in PROCESS_GROUP_OPS


def test_message_size_follows_nccl_tests():
    gather = {"input_sizes": [[4224]], "output_sizes": [[2, 4224]], "input_dtypes": ["Float"],
              "output_dtypes": ["Float"]}
    assert entry_nbytes(gather, "all_gather") == 2 * 4224 * 4
    reduce = {"input_sizes": [[10], [3, 2]], "output_sizes": [[10], [3, 2]], "input_dtypes": ["BFloat16", "Long"]}
    assert entry_nbytes(reduce, "all_reduce") == 10 * 2 + 6 * 8


def test_reads_each_entry_once_across_polls():
    rec, reader, sink, drops, errors = make()
    for _ in range(3):
        rec.collective(op="gloo:all_gather", numel=8)
    reader.poll()
    for _ in range(2):
        rec.collective(op="gloo:all_reduce", numel=4)
    reader.poll()
    reader.poll()   # nothing new
    assert sink.children[("count", "default", "0", "all_gather")].value == 3
    assert sink.children[("bytes", "default", "0", "all_gather")].value == 3 * 8 * 4
    assert sink.children[("count", "default", "0", "all_reduce")].value == 2
    assert sink.children[("enqueued", "default", "0")].value == 5
    assert sink.children[("completed", "default", "0")].value == 5
    assert reader.entries_read == 5 and drops == [] and errors == []


def test_entries_overwritten_in_the_ring_are_counted_as_dropped():
    rec, reader, sink, drops, errors = make()
    rec.size = 4
    rec.collective()
    reader.poll()
    for _ in range(10):
        rec.collective()
    reader.poll()
    assert sink.children[("count", "default", "0", "all_reduce")].value == 1 + 4
    assert drops == [("flight_recorder", 6)] and errors == []


def test_durations_are_published_where_the_backend_gives_them():
    rec, reader, sink, drops, errors = make()
    rec.collective(op="nccl:all_reduce", duration_ms=2.5)
    rec.collective(op="gloo:all_reduce")
    reader.poll()
    assert sink.children[("duration", "default", "all_reduce")].observed == [0.0025]


def test_an_nccl_duration_written_after_the_first_read_is_still_published():
    rec, reader, sink, drops, errors = make()
    rec.collective(op="nccl:_allgather_base", retired=False)   # not completed yet when first read
    reader.poll()
    assert ("duration", "default", "all_gather") not in sink.children
    rec.entries[-1].update(duration_ms=1.5, time_discovered_completed_ns=5, retired=True)
    rec.collective(op="nccl:all_reduce", duration_ms=0.5, time_discovered_completed_ns=6)
    reader.poll()
    assert sink.children[("duration", "default", "all_gather")].observed == [0.0015]
    assert sink.children[("duration", "default", "all_reduce")].observed == [0.0005]
    assert sink.children[("count", "default", "0", "all_gather")].value == 1   # counted once
    assert reader.cursors["cpu"].pending_duration == {}


def test_an_nccl_entry_completed_but_not_retired_keeps_waiting_for_its_duration():
    """A read's copy of the ring marks a finished collective completed at once
    (time_discovered_completed_ns); NCCL's watchdog writes its duration_ms only when it retires
    it, a watchdog period later. The newest collectives of every read are such entries: taken
    as final, their durations were never published."""
    rec, reader, sink, drops, errors = make()
    rec.collective(op="nccl:all_reduce", time_discovered_completed_ns=5, retired=False)
    reader.poll()
    assert list(reader.cursors["cpu"].pending_duration) == [0]
    rec.entries[-1].update(duration_ms=3.0, retired=True)
    rec.collective(op="nccl:all_reduce", time_discovered_completed_ns=6, retired=True)   # retired without one
    reader.poll()
    assert sink.children[("duration", "default", "all_reduce")].observed == [0.003]
    assert reader.cursors["cpu"].pending_duration == {}
    assert sink.children[("count", "default", "0", "all_reduce")].value == 2 and errors == []


def test_durations_still_pending_when_overwritten_are_given_up():
    rec, reader, sink, drops, errors = make()
    rec.size = 3
    rec.collective(op="nccl:all_reduce", retired=False)   # not completed when read: its duration is pending
    reader.poll()
    assert list(reader.cursors["cpu"].pending_duration) == [0]
    for _ in range(5):                             # overwritten in the ring meanwhile
        rec.collective(op="nccl:all_reduce", time_discovered_completed_ns=1)
    reader.poll()
    assert reader.cursors["cpu"].pending_duration == {}
    assert sink.children[("count", "default", "0", "all_reduce")].value == 1 + 3
    assert drops == [("flight_recorder", 2)]


def test_the_nccl_recorder_is_read_besides_the_cpu_one_each_with_its_own_record_ids():
    """ProcessGroupNCCL keeps its own flight recorder (libtorch_cuda), whose record ids start at
    0 like the CPU one's: an NCCL job's FSDP/TP collectives are only there, and a cursor shared
    between the two would skip or re-count entries."""
    cpu, nccl = FakeRecorder(), FakeRecorder()
    sink, drops, errors = Sink(), [], []
    reader = ProcessGroupReader(sink, lambda what, reason="", n=1: drops.append((what, n)), lambda: errors.append(1),
                                Source(cpu=cpu, nccl=nccl), 8, 60.0, entries_every_s=0.0, initialized=lambda: True)
    reader._ring = 0
    done = {"time_discovered_completed_ns": 1}   # NCCL's watchdog saw them complete (no duration to wait for)
    for _ in range(3):
        nccl.collective(pg_id=0, name="0", desc="default_pg", op="nccl:_allgather_base", numel=8, **done)
    nccl.collective(pg_id=1, name="1", desc="mesh_dp_shard", op="nccl:_reduce_scatter_base", numel=16, **done)
    cpu.collective(pg_id=2, name="2", desc="undefined", op="gloo:barrier", numel=1)   # a gloo side group
    reader.poll()
    for _ in range(2):
        nccl.collective(pg_id=0, name="0", desc="default_pg", op="nccl:all_reduce", numel=4, **done)
    cpu.collective(pg_id=2, name="2", desc="undefined", op="gloo:barrier", numel=1)
    reader.poll()
    reader.poll()   # nothing new in either
    assert sink.children[("count", "default", "0", "all_gather")].value == 3
    assert sink.children[("count", "default", "0", "all_reduce")].value == 2
    assert sink.children[("count", "dp_shard", "1", "reduce_scatter")].value == 1
    assert sink.children[("count", "pg2", "2", "barrier")].value == 2
    assert sink.children[("enqueued", "default", "0")].value == 5
    assert sink.children[("enqueued", "pg2", "2")].value == 2
    assert reader.cursors["nccl"].last_record == 5 and reader.cursors["cpu"].last_record == 1
    assert reader.entries_read == 8 and drops == [] and errors == []   # each entry decoded once
