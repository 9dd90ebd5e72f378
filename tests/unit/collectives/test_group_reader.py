"""rankscope.collectives.group_reader without a job: when the reader reads each ring (half the
ring new, a possible hang, the read budget, a read that holds the GIL), the default group
before a rank's first collective, collective timing, and a flight recorder turned off.
The same reader against a real recorder is tested in test_collectives_process_groups.py."""

from __future__ import annotations

import math

from rankscope.collectives.group_reader import ProcessGroupReader
from tests.unit.collectives.fakes import FakeRecorder, Sink, Source, make


def test_a_rank_before_its_first_collective_publishes_the_default_group_at_zero():
    """A rank stuck before its first collective (its recorder knows no group yet) is 1 behind a
    peer that issued one: the default group is published at 0 until the status names it, only
    on the default group's recorder, and only once the process group exists."""
    rec, reader, sink, drops, errors = make()
    reader.poll()
    assert sink.children[("enqueued", "default", "0")].value == 0
    assert sink.children[("completed", "default", "0")].value == 0
    rec.collective()
    reader.poll()
    assert sink.children[("enqueued", "default", "0")].value == 1 and errors == []
    # Named by its mesh dimension since (watch() over FSDP2 on the whole world): the placeholder's
    # series are retired (NaN), the group's are published under its name.
    rec2, named, sink2, _, errors2 = make()
    named.poll()
    named.roles = {"0": "dp_shard"}
    rec2.collective()
    named.poll()
    assert math.isnan(sink2.children[("enqueued", "default", "0")].value)
    assert sink2.children[("enqueued", "dp_shard", "0")].value == 1 and errors2 == []
    other = ProcessGroupReader(Sink(), lambda *a, **k: None, lambda: None, Source(cpu=FakeRecorder()), 8, 60.0,
                               initialized=lambda: True, default_recorder=lambda: "nccl")
    other.poll()
    assert other.groups == {}   # a NCCL job's CPU recorder: not its default group's numbers
    before_init = ProcessGroupReader(Sink(), lambda *a, **k: None, lambda: None, Source(cpu=FakeRecorder()), 8,
                                     60.0, initialized=lambda: False, default_recorder=lambda: "cpu")
    before_init.poll()
    assert before_init.groups == {}


def test_a_collective_stuck_across_two_status_reads_is_looked_up_at_once():
    rec, reader, sink, drops, errors = make()
    reader._entries_every_s = 3600.0
    rec.collective()
    reader.poll()                       # the first read is due (entries_every_s from 0)
    rec.collective(op="gloo:broadcast", complete=False, t=300.0)
    reader.poll()                       # seen in flight once: not yet read
    assert ("in_flight", "default", "0", "broadcast") not in sink.children
    reader.poll()                       # still in flight: read now
    assert sink.children[("in_flight", "default", "0", "broadcast")].value == 300.0


def test_entries_are_read_once_half_the_ring_is_new_by_the_sequence_numbers():
    rec, reader, sink, drops, errors = make()
    reader._entries_every_s, reader._ring = 1.0, 10
    cursor = reader.cursors["cpu"]
    cursor.last_entries = 100.0
    assert not reader._read_due(cursor, 100.5, 50)     # never closer than 1 s
    assert not reader._read_due(cursor, 102.0, 4)      # 4 of a 10-entry ring are new: not yet
    assert reader._read_due(cursor, 102.0, 5)          # half the ring
    assert reader._read_due(cursor, 110.0, 0)          # at least every 10 s


def test_a_poll_reads_entries_only_when_half_the_ring_is_new():
    rec, reader, sink, drops, errors = make()
    reader._ring = rec.size = 10
    for _ in range(6):
        rec.collective()
    reader.poll()                              # the first read
    count = sink.children[("count", "default", "0", "all_reduce")]
    assert count.value == 6
    for _ in range(3):
        rec.collective()
    reader.poll()                              # 3 new of 10: not worth serialising the ring
    assert count.value == 6
    assert sink.children[("enqueued", "default", "0")].value == 9   # sequence numbers move regardless
    for _ in range(2):
        rec.collective()
    reader.poll()                              # 5 new: read
    assert count.value == 11 and drops == []
    rec.collective(pg_id=1, name="1", desc="mesh_tp")
    reader.poll()                              # a group not known yet: read at once, for its labels
    assert sink.children[("enqueued", "tp", "1")].value == 1


def test_collective_timing_is_turned_on_for_every_process_group(monkeypatch):
    """RANKSCOPE_COLLECTIVE_TIMING=1: each group, once (gloo accepts the call and records no durations)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from tests.helpers.jobs import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        calls = []
        monkeypatch.setattr(type(dist.group.WORLD), "_enable_collectives_timing", lambda pg: calls.append(pg))
        rec, reader, sink, drops, errors = make()
        reader._timing = True
        reader.poll()
        sub = dist.new_group([0])
        reader.poll()
        reader.poll()
        assert calls == [dist.group.WORLD, sub] and errors == []
        assert set(distributed_c10d._world.pg_names.values()) == reader._timed_groups
    finally:
        dist.destroy_process_group()


def test_a_flight_recorder_turned_off_is_named_once_with_the_flag_that_did_it(monkeypatch, caplog):
    """torchtitan's --comm.trace_buf_size 0 sets TORCH_FR_BUFFER_SIZE=0: every FSDP collective count
    disappears. The warning names the variable and its value, and how many entries to give it."""
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")
    reader = ProcessGroupReader(Sink(), lambda *a, **k: None, lambda: None, Source(cpu=FakeRecorder()), 8, 60.0,
                                entries_every_s=0.0, initialized=lambda: True, ring=0)
    with caplog.at_level("WARNING", logger="rankscope"):
        reader._warn_if_recorder_off()
        reader._warn_if_recorder_off()
    warnings = [r.getMessage() for r in caplog.records if "flight recorder is off" in r.getMessage()]
    assert len(warnings) == 1
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE=0" in warnings[0] and "--comm.trace_buf_size" in warnings[0]
    assert "2000" in warnings[0]


def test_a_costly_ring_is_read_further_apart_unless_half_of_it_is_new():
    """A full 20,000-entry ring takes ~0.7 s to serialise and decode: read every 10 s regardless,
    it would cost a job with few collectives 7% of a core. Unforced reads wait 100x the last
    read's time; half a ring of new collectives is always read (the ring would overwrite them)."""
    from rankscope.collectives.ring_entries import Cursor

    reader = ProcessGroupReader(Sink(), lambda *a, **k: None, lambda: None, Source(cpu=FakeRecorder()), 8, 60.0,
                                initialized=lambda: True, ring=20000)
    cheap, costly = Cursor("cpu", read_s=0.05), Cursor("cpu", read_s=0.7)
    assert reader._read_due(cheap, now=10.5, new_collectives=10)          # 10 s: the usual at-most
    assert not reader._read_due(costly, now=10.5, new_collectives=10)     # 0.7 s a read: 70 s apart
    assert not reader._read_due(costly, now=69.0, new_collectives=10)
    assert reader._read_due(costly, now=70.5, new_collectives=10)
    assert reader._read_due(costly, now=5.0, new_collectives=10_000)      # half the ring new: now


def test_a_ring_whose_read_holds_the_gil_is_read_only_at_the_budget_or_on_a_hang():
    """NCCL's ring, where the rank's GPU is not 0, is serialised on the reader's thread holding
    the GIL (a 20,000-entry ring: ~0.35 s on this CPU): half a ring new no longer makes a read
    due, only the budget does (at most 1/READ_BUDGET of the time between reads); a collective
    in flight across two status reads (a possible hang) is still read at once."""
    rec, reader, sink, drops, errors = make()
    reader._entries_every_s, reader._ring = 1.0, 10
    cursor = reader.cursors["cpu"]
    cursor.last_entries, cursor.read_s = 100.0, 0.35
    assert reader._read_due(cursor, 102.0, 5)                        # the worker server's read: half the ring
    assert not reader._read_due(cursor, 102.0, 5, holds_gil=True)     # holding the GIL: not yet
    assert not reader._read_due(cursor, 134.0, 50, holds_gil=True)    # 100 x 0.35 s = 35 s between reads
    assert reader._read_due(cursor, 135.5, 0, holds_gil=True)

    class HoldingSource(Source):
        def holds_gil(self, recorder):
            return True

    source = HoldingSource(cpu=rec)
    reader = ProcessGroupReader(sink, lambda what, reason="", n=1: drops.append((what, n)),
                                lambda: errors.append(1), source, 2, 60.0, entries_every_s=0.0,
                                initialized=lambda: True)
    reader._ring = 10
    rec.collective()
    reader.poll()                                  # the first read (a group not known yet is read at once)
    cursor = reader.cursors["cpu"]
    cursor.read_s = 1.0                            # each read would hold the GIL for a second
    for _ in range(6):
        rec.collective()
    reader.poll()                                  # 6 of 10 new: not read while it would hold the GIL
    assert sink.children[("count", "default", "0", "all_reduce")].value == 1
    rec.collective(complete=False)
    reader.poll()
    reader.poll()                                  # in flight across two status reads: read now
    assert sink.children[("count", "default", "0", "all_reduce")].value == 8
