"""rankscope.collectives.process_groups without a job: op names, group labels, message sizes,
and the reader's bookkeeping over flight-recorder JSON as torch 2.13 writes it
(incremental reads, entries lost to the ring, the group budget, in-flight ages).
The same reader against a real recorder is tested in test_collectives_process_groups.py."""

from __future__ import annotations

import json
import math
import time

import pytest

from rankscope.contract.catalog import PROCESS_GROUP_OPS
from rankscope.collectives.process_groups import ProcessGroupReader, entry_nbytes, group_label, op_of
from rankscope.collectives.tracker import bus_factor, group_size


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


@pytest.mark.parametrize("name, desc, label", [
    ("0", "default_pg", "default"), ("1", "mesh_dp_shard", "dp_shard"), ("3", "mesh_tp", "tp"),
    ("5", "undefined", "pg5"), ("7", "", "pg7"), ("8", "My Pipeline/Stage 1", "my_pipeline_stage_1"),
    ("9", "x" * 80, "x" * 32),
])
def test_group_labels_are_roles_or_stable_ids(name, desc, label):
    assert group_label(name, desc) == label


def test_message_size_follows_nccl_tests():
    gather = {"input_sizes": [[4224]], "output_sizes": [[2, 4224]], "input_dtypes": ["Float"],
              "output_dtypes": ["Float"]}
    assert entry_nbytes(gather, "all_gather") == 2 * 4224 * 4
    reduce = {"input_sizes": [[10], [3, 2]], "output_sizes": [[10], [3, 2]], "input_dtypes": ["BFloat16", "Long"]}
    assert entry_nbytes(reduce, "all_reduce") == 10 * 2 + 6 * 8


@pytest.mark.parametrize("op, n, factor", [
    ("all_reduce", 8, 2 * 7 / 8), ("all_reduce", 2, 1.0), ("all_reduce", 1, 0.0),
    ("all_gather", 8, 7 / 8), ("reduce_scatter", 4, 3 / 4), ("all_to_all", 4, 3 / 4), ("gather", 4, 3 / 4),
    ("scatter", 4, 3 / 4), ("broadcast", 8, 1.0), ("reduce", 8, 1.0), ("send", 2, 1.0), ("recv", 2, 1.0),
    ("barrier", 8, 0.0)])
def test_bus_bandwidth_factors_are_nccl_tests(op, n, factor):
    """nccl-tests (doc/PERFORMANCE.md): busBw = algBw x the op's factor, so that every op reads
    against the link's speed. A group of one moves nothing over a bus."""
    assert bus_factor(op, n) == pytest.approx(factor)


def test_a_collective_group_that_is_no_process_group_is_refused_clearly():
    class Group:
        def size(self):
            return 4

    assert group_size(Group()) == 4
    with pytest.raises(TypeError, match="process group"):
        group_size([0, 1])


class Child:
    def __init__(self):
        self.value = 0.0
        self.observed: list[float] = []

    def inc(self, n=1.0):
        self.value += n

    def set(self, v):
        self.value = v

    def observe(self, v):
        self.observed.append(v)


class Sink:
    """ProcessGroupMetrics' interface, keeping values."""

    def __init__(self):
        self.children: dict[tuple, Child] = {}

    def _c(self, *key):
        return self.children.setdefault(key, Child())

    def process_group_counters(self, group, group_id, op):
        return (self._c("count", group, group_id, op), self._c("bytes", group, group_id, op),
                self._c("bus_bytes", group, group_id, op))

    def process_group_seq(self, group, group_id):
        return self._c("enqueued", group, group_id), self._c("completed", group, group_id)

    def process_group_in_flight(self, group, group_id, op):
        return self._c("in_flight", group, group_id, op)

    def process_group_duration(self, group, op):
        return self._c("duration", group, op)


class FakeRecorder:
    """A flight recorder ring of ``size`` entries, serialised as torch 2.13's fr_trace_json."""

    def __init__(self, size=2000):
        self.size = size
        self.entries: list[dict] = []
        self.status: dict[str, dict[str, str]] = {}
        self.next_record = 0
        self.seq: dict[int, int] = {}

    def collective(self, pg_id=0, name="0", desc="default_pg", op="gloo:all_reduce", numel=4, complete=True,
                   t=1000.0, **extra):
        seq = self.seq[pg_id] = self.seq.get(pg_id, 0) + 1
        entry = {"collective_seq_id": seq, "input_dtypes": ["Float"], "input_sizes": [[numel]], "is_p2p": False,
                 "op_id": seq, "output_dtypes": ["Float"], "output_sizes": [[numel]], "p2p_seq_id": 0,
                 "pg_id": pg_id, "process_group": [name, desc], "profiling_name": op,
                 "record_id": self.next_record, "retired": True, "state": "scheduled", "thread_id": "1",
                 "thread_name": "python", "time_created_ns": int(t * 1e9), "time_discovered_completed_ns": 0,
                 "time_discovered_started_ns": 0, "timeout_ms": 1800000, **extra}
        self.next_record += 1
        self.entries = (self.entries + [entry])[-self.size:]
        s = self.status.setdefault(str(pg_id), {"last_completed_collective": "-1", "last_enqueued_collective": "-1",
                                                "last_started_collective": "-1"})
        s["last_enqueued_collective"] = str(seq)
        if complete:
            s["last_completed_collective"] = str(seq)

    def complete(self, pg_id=0):
        s = self.status[str(pg_id)]
        s["last_completed_collective"] = s["last_enqueued_collective"]

    def entries_json(self) -> bytes:
        doc = {"comm_lib_version": "", "entries": self.entries, "nccl_comm_state": {}, "pg_config": {},
               "pg_status": self.status, "version": "2.10"}
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    def close(self):
        pass


class Source:
    """FlightRecorderSource's interface over fake recorders, by name."""

    def __init__(self, **recorders: FakeRecorder):
        self.by_name = recorders
        self.recorders = tuple(recorders)

    def status(self, recorder):
        return self.by_name[recorder].status

    def entries_json(self, recorder):
        return self.by_name[recorder].entries_json()

    def close(self):
        pass


def make():
    rec = FakeRecorder()
    source = Source(cpu=rec)
    sink, drops, errors = Sink(), [], []
    reader = ProcessGroupReader(sink, lambda what, reason="", n=1: drops.append((what, n)), lambda: errors.append(1),
                                source, 2, 60.0, entries_every_s=0.0, initialized=lambda: True,
                                default_recorder=lambda: "cpu")
    reader._ring = 0   # no pacing: every poll reads the entries
    return rec, reader, sink, drops, errors


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


def test_groups_beyond_the_budget_are_dropped_and_counted():
    rec, reader, sink, drops, errors = make()   # budget: 2 groups
    rec.collective(pg_id=0, name="0", desc="default_pg")
    rec.collective(pg_id=1, name="1", desc="mesh_dp")
    rec.collective(pg_id=2, name="3", desc="mesh_tp")
    rec.collective(pg_id=2, name="3", desc="mesh_tp")
    reader.poll()
    assert {k[1] for k in sink.children if k[0] == "count"} == {"default", "dp"}
    assert drops == [("process_group", 1), ("process_group", 1)]


def test_in_flight_collective_publishes_its_enqueue_time_until_it_completes():
    rec, reader, sink, drops, errors = make()
    rec.collective(op="gloo:all_gather", t=100.0)
    rec.collective(op="gloo:all_gather", complete=False, t=200.0)
    reader.poll()
    in_flight = sink.children[("in_flight", "default", "0", "all_gather")]
    assert in_flight.value == 200.0
    assert sink.children[("enqueued", "default", "0")].value == 2
    assert sink.children[("completed", "default", "0")].value == 1
    rec.complete()
    reader.poll()
    assert in_flight.value == 0.0


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


def test_the_cpu_half_of_a_group_with_two_backends_is_its_own_sequence(monkeypatch):
    """A "cuda:nccl,cpu:gloo" group numbers its NCCL and its gloo collectives separately; published
    under one group_id the two sequences would be compared as one (a false CollectiveBehind)."""
    from rankscope.collectives import process_groups

    monkeypatch.setattr(process_groups, "_has_cuda_backend", lambda name: name == "0")
    cpu, nccl = FakeRecorder(), FakeRecorder()
    sink = Sink()
    reader = ProcessGroupReader(sink, lambda *a, **k: None, lambda: None, Source(cpu=cpu, nccl=nccl), 8, 60.0,
                                entries_every_s=0.0, initialized=lambda: True)
    reader._ring = 0
    for _ in range(4):
        nccl.collective(pg_id=0, name="0", desc="default_pg", op="nccl:all_reduce")
    cpu.collective(pg_id=0, name="0", desc="default_pg", op="gloo:all_reduce")
    reader.poll()
    assert sink.children[("enqueued", "default", "0")].value == 4
    assert sink.children[("enqueued", "default", "0.cpu")].value == 1
    assert sink.children[("count", "default", "0.cpu", "all_reduce")].value == 1


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
    from rankscope.collectives.process_groups import Cursor

    reader = ProcessGroupReader(Sink(), lambda *a, **k: None, lambda: None, Source(cpu=FakeRecorder()), 8, 60.0,
                                initialized=lambda: True, ring=20000)
    cheap, costly = Cursor("cpu", read_s=0.05), Cursor("cpu", read_s=0.7)
    assert reader._read_due(cheap, now=10.5, new_collectives=10)          # 10 s: the usual at-most
    assert not reader._read_due(costly, now=10.5, new_collectives=10)     # 0.7 s a read: 70 s apart
    assert not reader._read_due(costly, now=69.0, new_collectives=10)
    assert reader._read_due(costly, now=70.5, new_collectives=10)
    assert reader._read_due(costly, now=5.0, new_collectives=10_000)      # half the ring new: now


def test_a_group_the_monitor_knows_from_the_mesh_is_named_by_its_dimension():
    """torchtitan's FSDP over the whole world runs on the default group: it reads dp_shard, the
    mesh dimension's name (rankscope.layout.group_roles), not "default"."""
    rec = FakeRecorder()
    sink = Sink()
    reader = ProcessGroupReader(sink, lambda *a, **k: None, lambda: None, Source(cpu=rec), 8, 60.0,
                                entries_every_s=0.0, initialized=lambda: True)
    reader.roles = {"0": "dp_shard"}
    rec.collective(pg_id=0, name="0", desc="default_pg", op="gloo:all_gather")
    rec.collective(pg_id=1, name="1", desc="mesh_tp", op="gloo:all_reduce")
    reader.poll()
    assert sink.children[("count", "dp_shard", "0", "all_gather")].value == 1
    assert sink.children[("count", "tp", "1", "all_reduce")].value == 1


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


def test_a_group_whose_status_counts_its_sends_publishes_its_collectives_numbers():
    """Measured on gloo (2.13): a pipeline group's status numbers every op, sends and receives
    included, while its entries record only the collectives (collective_seq_id 1, 2, ...). The
    middle stage of three that sent and received 10 times and then missed the group's second
    all-reduce read 11 against its waiting peers' 7: the culprit looked ahead, the waiting
    stages behind. The entries' numbers are the ones to compare: 1 for it, 2 for its peers."""
    culprit_rec, culprit, culprit_sink, _, errors = make()
    culprit_rec.collective(op="gloo:all_reduce")                        # seq 1, retired
    culprit_rec.status["0"].update(last_enqueued_collective="11", last_completed_collective="11")
    culprit.poll()
    assert culprit_sink.children[("enqueued", "default", "0")].value == 1
    assert culprit_sink.children[("completed", "default", "0")].value == 1

    peer_rec, peer, peer_sink, _, errors = make()
    peer_rec.collective(op="gloo:all_reduce")                           # seq 1, retired
    peer_rec.collective(op="gloo:all_reduce", complete=False, retired=False, t=1234.0)   # seq 2, waiting
    peer_rec.status["0"].update(last_enqueued_collective="7", last_completed_collective="6")
    peer.poll()
    assert peer_sink.children[("enqueued", "default", "0")].value == 2
    assert peer_sink.children[("completed", "default", "0")].value == 1
    assert peer_sink.children[("in_flight", "default", "0", "all_reduce")].value == 1234.0   # its wait published
    peer_rec.entries[-1]["retired"] = True                               # the wait ends
    peer_rec.status["0"].update(last_enqueued_collective="8", last_completed_collective="8")
    peer.poll()                                                          # read again until retired
    assert peer_sink.children[("completed", "default", "0")].value == 2
    assert peer_sink.children[("in_flight", "default", "0", "all_reduce")].value == 0
    assert peer.cursors["cpu"].unretired == {} and errors == []


def test_nccl_p2p_entries_keep_the_status_numbers_out_of_the_comparison():
    """NCCL records its p2p work as entries (is_p2p); the status numbers it with another counter:
    a group with p2p entries publishes its collectives' numbers."""
    rec, reader, sink, drops, errors = make()
    for _ in range(5):
        rec.collective(op="nccl:send", is_p2p=True, time_discovered_completed_ns=1)
    rec.collective(op="nccl:all_reduce", time_discovered_completed_ns=1)   # collective seq 6 in the fake
    rec.status["0"].update(last_enqueued_collective="40", last_completed_collective="40")
    reader.poll()
    assert sink.children[("enqueued", "default", "0")].value == 6
    assert sink.children[("count", "default", "0", "send")].value == 5 and errors == []


def test_a_group_without_other_work_keeps_its_status_numbers():
    rec, reader, sink, drops, errors = make()
    for _ in range(3):
        rec.collective(op="gloo:all_reduce")
    reader.poll()
    rec.collective(op="gloo:all_reduce")
    rec.collective(op="gloo:all_reduce", complete=False, retired=False)
    reader._ring = 1000   # entries not due: the status alone moves the numbers between reads
    reader.cursors["cpu"].last_entries = time.monotonic()
    reader.poll()
    assert sink.children[("enqueued", "default", "0")].value == 5
    assert sink.children[("completed", "default", "0")].value == 4
    assert not reader.groups[("cpu", "0")].counts_p2p
