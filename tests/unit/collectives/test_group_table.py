"""rankscope.collectives.group_table without a job: group labels, the group budget, the
sequence numbers and in-flight ages each group publishes, over flight-recorder JSON as torch
2.13 writes it. The same reader against a real recorder is tested in
test_collectives_process_groups.py."""

from __future__ import annotations

import time

import pytest

from rankscope.collectives.group_reader import ProcessGroupReader
from rankscope.collectives.group_table import group_label
from tests.unit.collectives.fakes import FakeRecorder, Sink, Source, make


@pytest.mark.parametrize("name, desc, label", [
    ("0", "default_pg", "default"), ("1", "mesh_dp_shard", "dp_shard"), ("3", "mesh_tp", "tp"),
    ("5", "undefined", "pg5"), ("7", "", "pg7"), ("8", "My Pipeline/Stage 1", "my_pipeline_stage_1"),
    ("9", "x" * 80, "x" * 32),
])
def test_group_labels_are_roles_or_stable_ids(name, desc, label):
    assert group_label(name, desc) == label


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


def test_the_cpu_half_of_a_group_with_two_backends_is_its_own_sequence(monkeypatch):
    """A "cuda:nccl,cpu:gloo" group numbers its NCCL and its gloo collectives separately; published
    under one group_id the two sequences would be compared as one (a false CollectiveBehind)."""
    from rankscope.collectives import group_table

    monkeypatch.setattr(group_table, "_has_cuda_backend", lambda name: name == "0")
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
