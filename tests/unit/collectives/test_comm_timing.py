"""DDP's comm timing (rankscope.collectives.comm_timing): the reducer mode fails at watch() without
DDP's timers, and a long backward is waiting, never compute, even when the whole fabric slows."""

from __future__ import annotations

import pytest

from rankscope.collectives.tracker import CollectiveTracker
from rankscope.config import ConfigError
from rankscope.device.rank_device import RankDevice


def test_reducer_mode_without_ddp_timers_fails_at_watch(tmp_path, monkeypatch):
    """comm_timing=reducer reads DDP's private runtime-logging API: if a torch
    release drops it, watch() says so at start-up instead of failing mid-run."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from rankscope.monitor import Monitor

    class DdpWithoutTimers(DistributedDataParallel):   # a DDP whose private logging API is gone
        def __init__(self):
            torch.nn.Module.__init__(self)   # no process group needed: nothing is reduced here
            self.module = torch.nn.Linear(2, 2)
            self._comm_hooks = []

        def register_comm_hook(self, state, hook):
            raise AssertionError("reducer mode must not register a hook")

        def _get_ddp_logging_data(self):
            raise AttributeError("_get_ddp_logging_data")

        def _set_ddp_runtime_logging_sample_rate(self, rate):
            raise AttributeError("_set_ddp_runtime_logging_sample_rate")

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monitor = Monitor(exporter="off", metrics_dir=tmp_path, run="no-timers", publish_interval_s=60)
    try:
        with pytest.raises(ConfigError, match="comm_timing=reducer: cannot read DDP's timers.*use comm_timing=hook"):
            monitor.watch(DdpWithoutTimers())
        plain = torch.nn.Linear(2, 2)   # FSDP2, tensor parallel, ...: seen through the flight recorder
        assert monitor.watch(plain) is plain
        with pytest.raises(ConfigError, match="expected a torch.nn.Module"):
            monitor.watch(object())
    finally:
        monitor.close()


def test_reducer_timing_counts_a_long_backward_as_waiting_not_compute():
    """DDP's timers are read on 1 step in 10. A peer frozen for 30 s makes this
    rank's backward last 30 s on a step the last sample knows nothing of: that
    time is waiting (comm_wait), or the rank would look like a straggler."""
    from rankscope.collectives.comm_timing import ReducerTiming

    class SampledTimers:
        exposed = 0.002   # the last sample: 2 ms of exposed all-reduce
        compute = 0.0     # no sample of the compute yet: the clipped moving average stands in

    timing = ReducerTiming(CollectiveTracker(RankDevice(lambda what, reason: None)), on_error=lambda: None)
    timing.timers = SampledTimers()
    for _ in range(50):
        assert timing.exposed_wait(0.0, 0.012, 0.012) == pytest.approx(0.002)   # usual steps: the sample
    assert timing.exposed_wait(0.0, 30.0, 30.0) == pytest.approx(30.0 - 0.012, rel=1e-3)
    assert timing.usual_backward < 0.03                                        # the wait did not become usual
    assert timing.exposed_wait(0.0, 0.013, 0.013) == pytest.approx(0.002)


def test_reducer_timing_never_learns_a_fabric_wide_wait_as_compute():
    """A slow fabric slows every step's all-reduce: every backward is 30x its compute, on
    every rank and every step. The usual backward is DDP's sampled compute, so the wait stays
    a wait however long it lasts; a clipped moving average of the whole backward would learn
    it within a hundred steps and book it as every rank's compute."""
    from rankscope.collectives.comm_timing import ReducerTiming

    class SampledTimers:
        exposed = 0.29    # the sampled step waited 290 ms after its compute
        compute = 0.010   # and computed 10 ms

    timing = ReducerTiming(CollectiveTracker(RankDevice(lambda what, reason: None)), on_error=lambda: None)
    timing.timers = SampledTimers()
    for _ in range(1000):
        assert timing.exposed_wait(0.0, 0.30, 0.30) == pytest.approx(0.29)
    # The compute itself doubles (a slower GPU): DDP's samples say so, and it is compute.
    SampledTimers.exposed, SampledTimers.compute = 0.0, 0.020
    assert timing.exposed_wait(0.0, 0.021, 0.021) == pytest.approx(0.0)
    assert timing.usual_backward == pytest.approx(0.020)
