"""The rank's device (rankscope.device) against the strict CUDA double: device spans read lazily
and in order, the device learnt once, host collectives in flight, CUDA phases from events read
later, the memory limit from the process's own cgroup."""

from __future__ import annotations

import time

import pytest

from rankscope.collectives.tracker import CollectiveTracker
from rankscope.device.rank_device import RankDevice
from tests.helpers.strict_cuda import StrictCuda, in_thread


def test_device_spans_are_read_lazily_in_order_and_events_reused():
    with StrictCuda(rank_device=0) as cuda:
        cuda.set_device(0)
        device = RankDevice(lambda what, reason: None)
        device.bind("cuda:0")
        tracker = CollectiveTracker(device)
        with cuda.hold():                                   # the device is still busy with both
            a = tracker.begin_device("all_reduce", 1024, bucket=0)
            tracker.end_device(a)
            b = tracker.begin_device("all_reduce", 2048, bucket=1)
            tracker.end_device(b)
        assert set(tracker.in_flight()) == {"all_reduce"}
        assert tracker.poll_device() == 0                  # nothing finished: nothing read, nothing waited for
        b.start_event.done = b.end_event.done = True
        assert tracker.poll_device() == 0                  # launch order: b waits behind a
        a.start_event.done = a.end_event.done = True
        assert tracker.poll_device() == 2
        records = tracker.drain()
        assert [(r.bucket, r.nbytes) for r in records] == [(0, 1024), (1, 2048)]
        assert all(r.duration >= 0 for r in records) and tracker.in_flight() == {}
        created = device.events.created
        c = tracker.begin_device("broadcast", 8)           # events come back from the pool
        assert device.events.created == created == 4 and c.start_event in (a.start_event, a.end_event,
                                                                            b.start_event, b.end_event)


def test_the_rank_device_is_learnt_once_and_kept_once_events_exist(caplog):
    """Monitor() without a device: the first CUDA model or value names it. A different device
    later is taken only while no event exists yet (a model on cuda:3 after cuda:2 was named):
    an event created on one device cannot be recorded on another's stream."""
    with StrictCuda(rank_device=3):
        device = RankDevice(lambda what, reason: None)
        assert not device.bind(None) and not device.cuda
        assert device.bind("cuda:2") and device.index == 2
        assert not device.bind("cuda:2")                                       # the same: nothing changes
        assert device.bind("cuda:3") and device.index == 3                     # no event yet
        event = device.events.get()
        event.record(device.stream())
        assert event.stream.index == 3
        with caplog.at_level("WARNING", logger="rankscope"):
            assert not device.bind("cuda:0")
            assert not device.bind("cuda:1")
        assert device.index == 3 and len([r for r in caplog.records if "not timed" in r.message]) == 1


def test_host_collectives_in_flight_and_bounded_buffer():
    tracker = CollectiveTracker(RankDevice(lambda what, reason: None))
    token, t0, start = tracker.begin("barrier")
    assert tracker.in_flight()["barrier"] == start
    tracker.end(token, "barrier", 0, t0, start)
    assert tracker.in_flight() == {}
    assert [r.op for r in tracker.drain()] == ["barrier"]
    for _ in range(tracker.completed.maxlen + 10):
        tracker.end(-1, "all_reduce", 4, time.perf_counter(), time.time())
    assert tracker.dropped == 10
    assert len(tracker.drain()) == tracker.completed.maxlen


def test_cuda_phases_come_from_events_read_later(tmp_path, monkeypatch):
    """The CUDA path of a step, with events that complete when the test says so."""
    from rankscope import monitor as monitor_module
    from rankscope.collectives.comm_timing import HookTiming

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with StrictCuda(rank_device=0) as cuda:
        cuda.set_device(0)
        monitor = monitor_module.Monitor(exporter="off", metrics_dir=tmp_path, run="cuda-path", backend="nccl",
                                         publish_interval_s=60, device="cuda:0")
        try:
            hook = HookTiming(monitor.parts.tracker, lambda: None)
            monitor.parts.watched.use_comm_timing(hook)   # as watch() sets it
            with cuda.hold(), monitor.step(samples=4) as step:
                with step.phase("forward"):
                    time.sleep(0.01)
                with step.phase("backward"):
                    bucket = monitor.parts.tracker.begin_device("all_reduce", 4096, bucket=0)
                    hook.last_device_span = bucket
                    time.sleep(0.02)
                    monitor.parts.tracker.end_device(bucket)
            in_thread(monitor.parts.publisher.publish)
            phase = monitor.parts.metrics.phase
            assert phase["forward"]._value.get() == 0                 # nothing read before the GPU is done
            with monitor.parts.device.on_device():
                assert monitor.parts.device.reads.ready_steps() == []
            cuda.release()
            in_thread(monitor.parts.publisher.publish)
            assert not monitor.parts.device.reads._steps
            forward, backward, comm = (phase[p]._value.get() for p in ("forward", "backward", "comm_wait"))
            assert forward >= 0.01
            assert comm == pytest.approx(bucket.duration) and comm >= 0.02   # last bucket: the exposed wait
            assert backward >= 0 and backward + comm >= 0.02
            step_seconds = monitor.parts.metrics.step_duration._sum.get()
            assert sum(p._value.get() for p in phase.values()) == pytest.approx(step_seconds, rel=1e-6)
        finally:
            monitor.close()


def test_the_memory_limit_is_read_from_the_process_own_cgroup(tmp_path):
    """Under Slurm or systemd (cgroup v1, no namespace) the job's limit is in its
    own cgroup's directory; the mount's root file is the unlimited root cgroup."""
    from rankscope.device.memory import _cgroup_limit_files

    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/slurm/uid_1/job_7\n0::/user.slice\n")
    files = [str(p.relative_to(tmp_path)) for p in _cgroup_limit_files(str(proc), str(tmp_path))]
    assert files.index("memory/slurm/uid_1/job_7/memory.limit_in_bytes") < files.index(
        "memory/memory.limit_in_bytes")
    assert files[0] == "user.slice/memory.max"
