"""The step path driven without a Monitor: the timer ends a step, the handoff hands it over as one
positional record, the accounting takes everything since the last publish in one call and returns
its totals, and the publisher's writer puts them on the page."""

from __future__ import annotations

import collections
import math
import time

import torch
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from rankscope.collectives.comm_timing import CommTiming
from rankscope.collectives.tracker import CollectiveTracker
from rankscope.device.rank_device import RankDevice
from rankscope.errors import TelemetryErrors
from rankscope.publishing.metrics import RankMetrics
from rankscope.publishing.publisher import write_step_values
from rankscope.step.accounting import StepAccounting
from rankscope.step.goodput import Progress, TimeUse
from rankscope.step.handoff import StepHandoff
from rankscope.step.judging import Judge, JudgeSettings
from rankscope.step.records import DevicePhasesRead, DeviceValueRead, Overflow, StepEnded
from rankscope.step.timer import StepTimer
from rankscope.step.trace_feed import TraceFeed
from rankscope.step.watched import Watched
from rankscope.tracing.api import Tracing


class Drops(TelemetryErrors):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str]] = []

    def drop(self, what: str, reason: str, n: int = 1) -> None:
        self.seen.append((what, reason))


def step_path(tmp_path, comm: CommTiming | None = None):
    errors = Drops()
    device = RankDevice(errors.drop)
    tracker = CollectiveTracker(device)
    watched = Watched()
    if comm is not None:
        watched.use_comm_timing(comm)
    feed = TraceFeed(Tracing(), tracker)
    handoff = StepHandoff(device, watched, errors, feed)
    timer = StepTimer(tracker, watched, handoff.step_ended, errors.drop)
    judge = Judge(JudgeSettings(loss_window=50, loss_ema_alpha=0.1, spike_zscore=6.0, spike_warmup_steps=5,
                                grad_spike_factor=10.0))
    accounting = StepAccounting(judge, feed, TimeUse(time.perf_counter(), -1), Progress(tmp_path, 0), timer,
                                watched, errors)
    return timer, handoff, accounting, errors


def run_step(timer: StepTimer, number: int | None = None, samples: int = 0, tokens: int = 0, **values):
    with timer.arm(samples, tokens, number) as step:
        with step.phase("forward"):
            pass
        with step.phase("backward"):
            pass
        step.observe(**values)


def test_the_record_a_step_hands_over_is_laid_out_as_step_ended(tmp_path):
    """The training thread builds a plain tuple by position (the cheapest thing to build); the
    publisher reads it by StepEnded's field names. Every field is pinned here by a distinct value."""
    timer, handoff, _, _ = step_path(tmp_path)
    loss = torch.tensor(1.5)
    before = time.perf_counter()
    run_step(timer, number=41, samples=7, tokens=11, loss=loss, grad_norm=2.5, lr=0.125)
    (entry,) = handoff.entries
    assert type(entry) is tuple and len(entry) == len(StepEnded._fields)
    e = StepEnded._make(entry)
    assert (e.number, e.numbered, e.samples, e.tokens) == (41, True, 7, 11)
    assert before <= e.t0 <= e.t1 <= time.perf_counter()
    assert e.data_unlogged == 0.0 and e.exposed == 0.0 and e.on_device is False
    assert [name for name, _, _ in e.phase_log] == ["forward", "backward"]
    assert e.values[0] is loss and e.values[1:] == [2.5, 0.125]   # in OBSERVED_VALUES' order
    assert e.versions == [loss._version, None, None]   # floats have none


def test_one_take_returns_the_totals_of_steps_device_reads_overflow_and_ooms(tmp_path):
    timer, handoff, accounting, errors = step_path(tmp_path)
    for loss in (2.0, 1.0, math.nan):
        run_step(timer, samples=4, tokens=32, loss=loss, grad_norm=0.5)
    device = [DeviceValueRead("loss", 0.75, None), DeviceValueRead("grad_norm", math.inf, None),
              DeviceValueRead("lr", 0.01, None), DevicePhasesRead({"forward": 0.02, "backward": 0.03})]
    overflow = Overflow(steps=2, samples=8, tokens=64, last_step=99, last_duration=0.5, last_end=time.time() + 60)
    acc = accounting.take(handoff.entries, device, overflow, ooms=3)
    assert not handoff.entries   # taken
    assert acc.steps == 5 and acc.samples == 20 and acc.tokens == 160
    assert acc.last_step == 99 and acc.last_duration == 0.5   # the overflow's step ended last
    assert acc.observed == {"loss": 0.75, "grad_norm": math.inf, "lr": 0.01}   # each one's last reading
    assert acc.nonfinite_loss == 1 and acc.nonfinite_grad == 1   # every reading judged: the NaN loss, the inf norm
    assert acc.ooms == 3
    assert acc.last_compute == 0.05   # the device's phases of the last step
    again = accounting.take(handoff.entries, (), Overflow(), ooms=3)
    assert again.steps == 0 and again.ooms == 0   # the OOM count is taken as a delta
    assert errors.seen == []


def test_a_spike_is_judged_once_and_counted_by_the_accounting_alone(tmp_path):
    timer, handoff, accounting, _ = step_path(tmp_path)
    for _ in range(20):
        run_step(timer, loss=1.0 + 1e-3 * (_ % 3))
    run_step(timer, loss=50.0)
    acc = accounting.take(handoff.entries, (), Overflow(), 0)
    assert acc.loss_spikes == 1 and acc.nonfinite_loss == 0 and acc.loss_z > 6 and acc.loss_ema > 1.0


def test_a_watched_ddp_timing_that_samples_its_waits_leaves_backward_out_of_compute(tmp_path):
    """The comm timing has one holder (Watched): what watch() puts there, the accounting reads."""
    class Sampled(CommTiming):
        waits_known_each_step = False

    timer, handoff, accounting, _ = step_path(tmp_path, Sampled())
    with timer.arm(0, 0, None) as step:
        with step.phase("forward"):
            time.sleep(0.002)
        with step.phase("backward"):
            time.sleep(0.02)
    acc = accounting.take(handoff.entries, (), Overflow(), 0)
    assert 0.002 <= acc.last_compute < 0.02


def test_the_totals_reach_the_page_in_one_fenced_stretch(tmp_path):
    timer, handoff, accounting, _ = step_path(tmp_path)
    run_step(timer, number=7, loss=0.25, grad_norm=3.0, lr=0.5)
    acc = accounting.take(handoff.entries, (), Overflow(), 0)
    (tmp_path / "m").mkdir()
    metrics = RankMetrics(tmp_path / "m", {"rank": "0", "local_rank": "0", "node": "n", "run": "r"})
    write_step_values(metrics, acc)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, str(tmp_path / "m"))
    page = {s.name: s.value for family in registry.collect() for s in family.samples}
    assert page["rankscope_step"] == 7 and page["rankscope_loss"] == 0.25
    assert page["rankscope_grad_norm"] == 3.0 and page["rankscope_learning_rate"] == 0.5
    assert page["rankscope_values_fence_begin"] == page["rankscope_values_fence_end"] == 1
