"""rankscope.collectives.ring_source without a job: which recorders a torch build has, which
reads need the rank's device, the status read, and c10's log level around the worker server.
The worker server's reads under a strict CUDA double are tested in test_cuda_rules.py; against
real recorders in test_collectives_process_groups.py."""

from __future__ import annotations

import ctypes
import json
from types import SimpleNamespace

from rankscope.collectives import ring_source
from rankscope.collectives.ring_source import FlightRecorderSource, available_recorders, recorder_holds_cuda_events


def _status_call(include_collectives: bool, only_active: bool) -> bytes:
    return json.dumps({"pg_status": {"0": {"last_enqueued_collective": "3"}}}).encode()


def test_the_recorders_a_torch_build_has():
    cpu_only = SimpleNamespace(_dump_fr_trace_json=_status_call)
    cuda_build = SimpleNamespace(_dump_fr_trace_json=_status_call, _dump_nccl_trace_json=_status_call)
    hooked = SimpleNamespace(_dump_fr_trace_json=_status_call, _dump_nccl_trace_json=_status_call,
                             FlightRecorderHook=object)   # every backend into the generic recorder too
    assert available_recorders(cpu_only) == ("cpu",)
    assert available_recorders(cuda_build) == ("cpu", "nccl")
    assert available_recorders(hooked) == ("cpu",)   # NCCL's collectives are there too: never counted twice
    assert available_recorders(SimpleNamespace(FlightRecorderHook=object)) == ()
    assert available_recorders(SimpleNamespace()) == ()


def test_reads_that_query_cuda_events_are_known():
    assert recorder_holds_cuda_events("nccl", SimpleNamespace())
    assert not recorder_holds_cuda_events("cpu", SimpleNamespace())
    assert recorder_holds_cuda_events("cpu", SimpleNamespace(FlightRecorderHook=object))


def test_the_nccl_recorder_is_not_read_before_the_rank_device_is_known(tmp_path):
    c10d = SimpleNamespace(_dump_fr_trace_json=_status_call, _dump_nccl_trace_json=_status_call)
    source = FlightRecorderSource(tmp_path, 0, c10d=c10d)
    assert source.recorders == ("cpu", "nccl")
    assert source.status("cpu") == {"0": {"last_enqueued_collective": "3"}}
    assert source.status("nccl") == {} and source.entries_json("nccl") == b""
    assert not source.holds_gil("cpu") and not source.holds_gil("nccl")
    source.close()   # no server started: nothing to stop


def test_c10_warnings_are_quiet_only_around_the_server_calls(monkeypatch):
    level = ctypes.c_int(1)   # c10 at warnings
    monkeypatch.setattr(ring_source, "_c10_log_level", lambda: level)
    with ring_source._c10_warnings_quiet():
        assert level.value == ring_source.C10_LOG_ERROR
    assert level.value == 1
    monkeypatch.setattr(ring_source, "_c10_log_level", lambda: None)   # the level cannot be reached
    with ring_source._c10_warnings_quiet():
        pass
