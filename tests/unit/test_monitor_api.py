"""The Monitor API against the loop shapes and mistakes of real code, in process.

Each test builds a real Monitor (metric files in tmp_path, no exporter) and
reads back what a node exporter would: the rank's merged multiprocess files.
The same cases run as real torchrun jobs in tests/integration/test_loop_shapes.py.
"""

from __future__ import annotations

import collections
import math
import threading
import time

import pytest
import torch
from prometheus_client.multiprocess import MultiProcessCollector

import rankscope
from rankscope import ConfigError, Monitor, UsageError
from rankscope.device.rank_device import EventPool
from rankscope.device.reads import MAX_PENDING, DeviceReads, DeviceValue
from rankscope.step.records import DeviceValueRead, Overflow
from tests.helpers.otlp_receiver import OtlpReceiver

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT",
               "TORCHELASTIC_RUN_ID")


@pytest.fixture
def monitor(tmp_path, monkeypatch):
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    m = Monitor(exporter="off", metrics_dir=tmp_path, run="api", publish_interval_s=60)
    yield m
    m.close()


def published(m: Monitor) -> dict[tuple, float]:
    """(name, extra label values...) -> value, as the exporter reads the rank's files."""
    m.parts.publisher.publish()
    files = [str(p) for p in m.run_dir.glob("*.db")]
    out = {}
    for family in MultiProcessCollector.merge(files, accumulate=True):
        for s in family.samples:
            extra = tuple(v for k, v in sorted(s.labels.items()) if k not in ("run", "rank", "local_rank", "node"))
            out[(s.name, *extra)] = s.value
    return out


def run_steps(m: Monitor, n: int, **observed) -> None:
    for _ in range(n):
        with m.step() as step:
            step.observe(**observed)


# -- values that are not plain floats ------------------------------------------------

def test_non_scalar_values_are_reduced_and_every_step_counts(monitor):
    run_steps(monitor, 3, loss=torch.arange(16.0), grad_norm=[torch.tensor(3.0), torch.tensor(4.0)],
              lr=[0.1, 0.01])
    got = published(monitor)
    assert got[("rankscope_steps_total",)] == 3
    assert got[("rankscope_loss",)] == pytest.approx(7.5)          # mean of 0..15
    assert got[("rankscope_grad_norm",)] == pytest.approx(5.0)     # sqrt(3² + 4²)
    assert got[("rankscope_learning_rate",)] == pytest.approx(0.1)  # the first param group
    assert got[("rankscope_telemetry_dropped_total", "value")] == 0


def test_dtensor_values_are_read_from_their_local_part_or_dropped(tmp_path, monitor):
    """FSDP2 / tensor-parallel loops hand over DTensors. A Replicate one is this rank's value; a
    Partial one (clip_grad_norm_'s result before .full_tensor()) holds only a summand, and a
    sharded grad norm only this rank's part: reading those would need a collective, which
    rankscope never issues from a background thread. They are dropped and counted, never
    published as if they were the value."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        replicated = distribute_tensor(torch.tensor([1.0, 2.0, 3.0, 4.0]), mesh, [Replicate()])
        run_steps(monitor, 1, loss=replicated, grad_norm=distribute_tensor(torch.tensor(3.0), mesh, [Replicate()]))
        got = published(monitor)
        assert got[("rankscope_loss",)] == pytest.approx(2.5) and got[("rankscope_grad_norm",)] == 3.0
        assert got[("rankscope_telemetry_dropped_total", "value")] == 0
        partial = DTensor.from_local(torch.tensor(7.0), mesh, [Partial()])
        sharded = distribute_tensor(torch.tensor([3.0, 4.0]), mesh, [Shard(0)])
        run_steps(monitor, 1, loss=torch.tensor(1.0), grad_norm=partial)
        run_steps(monitor, 1, loss=torch.tensor(1.0), grad_norm=sharded)
        got = published(monitor)
        assert got[("rankscope_telemetry_dropped_total", "value")] == 2
        assert got[("rankscope_grad_norm",)] == 3.0 and got[("rankscope_steps_total",)] == 3
    finally:
        dist.destroy_process_group()


def test_a_loss_still_in_the_autograd_graph_needs_no_detach(monitor):
    """The README passes the loss as it is: a scalar or per-sample loss that requires grad,
    observed before or after backward, is read right off the training thread."""
    w = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    with monitor.step() as step:
        per_sample = w * 2.0                            # reduction="none": requires grad
        step.observe(loss=per_sample)                   # before backward
        per_sample.sum().backward()
    with monitor.step() as step:
        loss = (w * w).sum()                            # 14.0
        loss.backward()
        step.observe(loss=loss, grad_norm=w.grad.norm())   # after backward
    got = published(monitor)
    assert got[("rankscope_loss",)] == pytest.approx(14.0)
    assert got[("rankscope_grad_norm",)] == pytest.approx(float((2 * torch.tensor([1.0, 2.0, 3.0]) + 2).norm()))
    assert got[("rankscope_telemetry_dropped_total", "value")] == 0
    assert got[("rankscope_telemetry_dropped_total", "value_modified")] == 0
    assert got[("rankscope_steps_total",)] == 2


@pytest.mark.parametrize("bad", ["0.5", {"loss": 1.0}, True, torch.tensor([]), [], torch.tensor([True, False])])
def test_a_value_that_is_not_a_number_is_a_counted_drop_and_the_step_still_counts(monitor, bad):
    run_steps(monitor, 4, loss=bad)
    got = published(monitor)
    assert got[("rankscope_steps_total",)] == 4
    assert got[("rankscope_telemetry_dropped_total", "value")] == 4
    assert ("rankscope_loss",) not in got                          # never a made-up value


def test_observe_after_its_step_ended_is_counted_and_changes_nothing(monitor):
    with monitor.step() as step:
        step.observe(loss=1.25)
    step.observe(loss=99.0)
    got = published(monitor)
    assert got[("rankscope_loss",)] == 1.25
    assert got[("rankscope_telemetry_dropped_total", "late_value")] == 1


def test_a_loss_tensor_modified_in_place_before_it_is_read_is_dropped_not_misreported(monitor):
    """A CPU tensor is read after its step (off the training thread): a loop that reuses
    the tensor it observed (a running total zeroed in place) must not publish the new value."""
    running = torch.zeros(())
    with monitor.step() as step:
        running += 2.5
        step.observe(loss=running)
    running.zero_()                                   # before the publisher reads it
    with monitor.step() as step:
        step.observe(loss=torch.tensor(1.5))          # a fresh tensor: read as usual
    got = published(monitor)
    assert got[("rankscope_loss",)] == 1.5
    assert got[("rankscope_telemetry_dropped_total", "value_modified")] == 1
    assert got[("rankscope_steps_total",)] == 2


# -- gradient accumulation: step time adds up to the loop's wall time ------------------

class SlowLoader:
    """Batches that take ``wait`` seconds each to arrive."""

    def __init__(self, n: int, wait: float):
        self.n, self.wait = n, wait

    def __iter__(self):
        for i in range(self.n):
            time.sleep(self.wait)
            yield i


def compute(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def run_loop(monitor: Monitor, shape: str, steps: int, micro: int, wait: float, work: float) -> tuple[float, int]:
    """The loop's wall time, and how many batches it fetched."""
    per_step = 1 if shape == "one_batch_per_step" else micro
    batches = iter(monitor.data(SlowLoader(steps * per_step, wait)))
    t0 = time.perf_counter()
    for _ in range(steps):
        if shape == "fetched_before_step":
            prefetched = [next(batches) for _ in range(micro)]
            with monitor.step() as step:
                for _ in prefetched:
                    with step.phase("forward"):
                        compute(work)
        elif shape == "fetched_inside_step":
            with monitor.step() as step:
                for _ in range(micro):
                    next(batches)
                    with step.phase("forward"):
                        compute(work)
        else:
            next(batches)
            with monitor.step() as step:
                with step.phase("forward"):
                    compute(work)
    return time.perf_counter() - t0, steps * per_step


@pytest.mark.parametrize("shape", ["fetched_inside_step", "fetched_before_step", "one_batch_per_step"])
def test_step_durations_add_up_to_the_loop_wall_time(monitor, shape):
    """Before the fix: +39% (batches drawn inside the step) and -38% (prefetched).

    The loop's own code between steps (µs) is the only time outside them, but
    a preemption landing there on a loaded 2-core machine can cost a few ms;
    so the best of three attempts must be within 2%. A wrong accounting is
    off in every attempt."""
    errors = []
    for _ in range(3):
        before = published(monitor)
        wall, batches = run_loop(monitor, shape, steps=5, micro=4, wait=0.03, work=0.02)
        got = published(monitor)

        def delta(key):
            return got[key] - before.get(key, 0.0)

        total = delta(("rankscope_step_duration_seconds_sum",))
        phases = sum(delta(k) for k in got if k[0] == "rankscope_phase_seconds_total")
        assert phases == pytest.approx(total, rel=1e-6)            # the phases partition each step
        data = delta(("rankscope_phase_seconds_total", "data"))
        assert batches * 0.03 <= data < batches * 0.03 * 1.5      # every wait, not the last one only
        errors.append(abs(total - wall) / wall)
        if errors[-1] <= 0.02:
            return
    pytest.fail(f"step durations vs wall time off by {[f'{e:.1%}' for e in errors]}")


# -- misuse fails loudly ----------------------------------------------------------------

def test_nested_steps_raise_and_the_outer_step_is_not_corrupted(monitor):
    with pytest.raises(UsageError, match="steps do not nest"):
        with monitor.step(samples=8):
            with monitor.step(samples=1):
                pass
    assert issubclass(UsageError, RuntimeError) and rankscope.UsageError is UsageError
    run_steps(monitor, 2)
    got = published(monitor)
    assert got[("rankscope_steps_total",)] == 2                    # the aborted outer step is not counted
    assert got[("rankscope_step",)] == 2                           # numbering continues: 0 (aborted), 1, 2


def test_a_second_monitor_in_one_process_is_refused_until_the_first_closes(tmp_path, monitor):
    with pytest.raises(ConfigError, match="already open in this process"):
        Monitor(exporter="off", metrics_dir=tmp_path, run="other")
    monitor.close()
    again = Monitor(exporter="off", metrics_dir=tmp_path, run="other", publish_interval_s=60)
    again.close()


# -- user metrics -------------------------------------------------------------------------

@pytest.mark.parametrize("name, labels, match", [
    ("acc²", (), "ASCII lower_snake_case"),
    ("accé", (), "ASCII lower_snake_case"),
    ("Acc", (), "ASCII lower_snake_case"),
    ("acc", ("split", "split"), "given twice"),
    ("acc", ("pid",), "reserved"),
    ("acc", ("rank",), "reserved"),
    ("acc", ("spl²t",), "ASCII"),
    ("acc_total", (), "only counters"),
])
def test_bad_user_metric_declarations_are_config_errors(monitor, name, labels, match):
    with pytest.raises(ConfigError, match=match):
        monitor.gauge(name, "a metric", labels)


def test_the_same_user_metric_twice_is_a_config_error(monitor):
    monitor.gauge("acc", "accuracy")
    with pytest.raises(ConfigError, match="acc"):
        monitor.gauge("acc", "accuracy again")


def test_user_metric_label_mistakes_are_counted_not_raised(monitor):
    plain = monitor.gauge("acc", "accuracy")
    split = monitor.gauge("split_acc", "accuracy per split", labels=("split",))
    plain.set(0.5, split="val")        # undeclared label
    split.set(0.5)                     # declared label missing
    split.set("high", split="val")     # not a number
    split.set(torch.tensor(0.75), split="train")
    got = published(monitor)
    assert got[("rankscope_telemetry_errors_total", "user")] == 3
    assert got[("rankscope_user_split_acc", "train")] == 0.75
    assert ("rankscope_user_acc",) not in got                     # the mistaken value was not written


# -- backend, drops, the publisher ----------------------------------------------------------

def test_backend_is_resolved_once_the_process_group_exists(tmp_path, monitor):
    import torch.distributed as dist

    assert ("rankscope_rank_info",) not in {k[:1] for k in published(monitor)}   # not known yet: not written
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        got = published(monitor)
    finally:
        dist.destroy_process_group()
    infos = [k for k in got if k[0] == "rankscope_rank_info"]
    assert len(infos) == 1 and "gloo" in infos[0], infos


def test_without_a_process_group_rank_info_is_written_after_the_first_step(monitor):
    run_steps(monitor, 1)
    infos = [k for k in published(monitor) if k[0] == "rankscope_rank_info"]
    assert len(infos) == 1


def test_dropped_step_durations_collectives_and_device_values_are_counted(monitor, monkeypatch):
    from rankscope.step import handoff

    monkeypatch.setattr(handoff, "MAX_PENDING_STEPS", 5)
    run_steps(monitor, 8)
    for _ in range(monitor.parts.tracker.completed.maxlen + 3):
        monitor.parts.tracker.end(-1, "all_reduce", 4, time.perf_counter(), time.time())
    got = published(monitor)
    assert got[("rankscope_steps_total",)] == 8                    # every step counted...
    assert got[("rankscope_step_duration_seconds_count",)] == 5    # ...3 durations dropped
    assert got[("rankscope_telemetry_dropped_total", "step_duration")] == 3
    assert got[("rankscope_telemetry_dropped_total", "collective")] == 3

    drops = []
    reads = DeviceReads(events=None, on_drop=lambda what, reason: drops.append(what))
    for i in range(MAX_PENDING + 2):
        if reads._room(reads._values, "device_value"):
            reads._values.append(i)
    assert drops == ["device_value", "device_value"]
    assert reads._values[0] == 0   # the newcomers are dropped: the publisher may be reading the oldest


def test_device_values_give_their_pinned_buffer_and_event_back_once_read():
    """A CUDA value is copied into a pinned buffer with an event after it; once read,
    both are reused by the next steps instead of being allocated per step."""
    class Event:
        def __init__(self):
            self.done = False

        def query(self) -> bool:
            return self.done

    pool = EventPool(Event)
    reads = DeviceReads(pool, on_drop=lambda what, reason: None)
    first, second = torch.tensor(1.5), torch.tensor(2.5, dtype=torch.float64)
    pending = [DeviceValue("loss", first, Event(), None), DeviceValue("grad", second, Event(), None)]
    reads._values.extend(pending)
    assert reads.ready_values() == []                 # the device is not done: nothing read, nothing reused
    pending[0].ready.done = True
    assert reads.ready_values() == [("loss", 1.5, None)]
    assert reads._pinned(torch.float32) is first      # the same buffer for the next float32 value...
    assert pool.get() is pending[0].ready             # ...and the same event
    pending[1].ready.done = True
    assert reads.ready_values() == [("grad", 2.5, None)]
    assert reads._pinned(torch.float64) is second


def test_publishes_never_overlap(monitor):
    """The OOM path and close() publish from the training thread; never inside the thread's own publish."""
    inside, most = [0], [0]
    lock = threading.Lock()
    original = monitor.parts.publisher._write_steps

    def slow_part():
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.02)
        original()
        with lock:
            inside[0] -= 1

    monitor.parts.publisher._write_steps = slow_part
    threads = [threading.Thread(target=monitor.parts.publisher.flush) for _ in range(4)]
    for t in threads:
        t.start()
    monitor.parts.publisher.flush()
    for t in threads:
        t.join()
    assert most[0] == 1


def test_a_cuda_anomaly_found_after_the_step_is_traced(tmp_path, monkeypatch):
    """On CUDA the loss is judged by the publisher once the device is done; a
    NaN found then is traced like one found on the training thread."""
    from rankscope.tracing.api import ATTR_ANOMALY, ATTR_STEP, ROOT_SPAN

    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)

    class DoneEvent:
        def query(self) -> bool:
            return True

    with OtlpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        monkeypatch.setenv("RANKSCOPE_TRACE_EVERY", "1000000")   # only step 0 is sampled
        m = Monitor(exporter="off", metrics_dir=tmp_path, run="cuda-nan", publish_interval_s=60)
        try:
            for _ in range(5):
                with m.step():
                    pass
            step = m.parts.steps.step
            context = m.parts.trace_feed.context_of(step, 0.01)   # what the step leaves for a deferred CUDA value
            reads = DeviceReads(EventPool(DoneEvent), on_drop=lambda what, reason: None)
            reads._values.append(DeviceValue("loss", torch.tensor(math.nan), DoneEvent(), context))
            m.parts.accounting.take(collections.deque(), map(DeviceValueRead._make, reads.ready_values()), Overflow(), 0)
        finally:
            m.close()
        receiver.wait_for_spans(lambda s: any(x.attributes.get(ATTR_ANOMALY) for x in s), timeout=10)
        roots = {s.attributes[ATTR_STEP]: s.attributes.get(ATTR_ANOMALY, "")
                 for s in receiver.spans() if s.name == ROOT_SPAN}
    assert roots.get(4) == "nonfinite_loss", roots


# -- how a monitor ends: finished only when the loop completed ------------------------------

def registration_of(m: Monitor):
    from rankscope.contract.rundir import load_registrations

    (reg,) = load_registrations(m.run_dir)
    return reg


def test_a_clean_close_is_finished(monitor):
    run_steps(monitor, 2)
    monitor.close()
    reg = registration_of(monitor)
    assert reg.finished_at and not reg.failed_at and reg.exception == ""


def test_leaving_the_monitor_on_an_exception_is_failed(tmp_path, monkeypatch):
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(KeyError):
        with Monitor(exporter="off", metrics_dir=tmp_path / "a", run="with") as m:
            raise KeyError("bad batch")
    reg = registration_of(m)
    assert reg.failed_at and not reg.finished_at and reg.exception == "KeyError"

    m = Monitor(exporter="off", metrics_dir=tmp_path / "b", run="finally")
    with pytest.raises(torch.OutOfMemoryError):
        try:
            raise torch.OutOfMemoryError("CUDA out of memory")
        finally:
            m.close()   # the usual try/finally: runs while the OOM propagates
    assert registration_of(m).exception == "OutOfMemoryError"


# -- start-up never fails because of the exporter --------------------------------------------

def test_an_exporter_port_that_never_answers_warns_and_the_rank_trains(tmp_path, monkeypatch, caplog):
    """A node exporter stopped (SIGSTOP), hung or busy holds its port but answers nothing:
    Monitor() once raised "metrics_port: cannot reach ...: timed out" and the job died. Now it
    warns, and the rank writes its files for whichever exporter answers later."""
    import socket

    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)   # accepted by the kernel, never read: a stopped process's port
        port = silent.getsockname()[1]
        with caplog.at_level("WARNING", logger="rankscope"):
            m = Monitor(exporter="auto", metrics_port=port, metrics_dir=tmp_path, run="silent-exporter",
                        publish_interval_s=60)
        try:
            run_steps(m, 3, loss=1.0)
            assert published(m)[("rankscope_steps_total",)] == 3
        finally:
            m.close()
    warned = [r.message for r in caplog.records if "does not answer" in r.message]
    assert len(warned) == 1 and f"127.0.0.1:{port}" in warned[0], warned


# -- from launch to the first step --------------------------------------------------------------

def test_startup_phases_from_launch_through_rendezvous_to_training(tmp_path, monkeypatch):
    """A Monitor made before init_process_group (as the adapters and the reference trainer make
    it) says where the rank is: launch, then rendezvous while init_process_group waits for a
    peer that never comes (torch's own timeout error passes through as it is), then first_step
    once a process group exists, training after the first step. init_process_group is torch's
    own again after close()."""
    import datetime
    import threading

    import torch.distributed as dist

    from tests.helpers.jobs import free_port

    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    original = dist.init_process_group
    m = Monitor(exporter="off", metrics_dir=tmp_path, run="startup-phases", publish_interval_s=60)

    def phase() -> tuple[str, float]:
        m.parts.publisher.publish()
        values = published(m)
        current = [p for p in ("launch", "rendezvous", "first_step", "training")
                   if values.get(("rankscope_startup_phase", p)) == 1.0]
        return current[0], values[("rankscope_startup_phase_since_timestamp_seconds",)]

    try:
        assert dist.init_process_group is not original
        name, launched = phase()
        assert name == "launch" and launched <= m.parts.registration.started_at   # since the process started
        assert published(m)[("rankscope_launch_world_size",)] == 1
        seen: list[tuple[str, float]] = []
        waiting = threading.Thread(target=lambda: (time.sleep(0.5), seen.append(phase())))
        waiting.start()
        with pytest.raises(Exception) as raised:   # a peer that never arrives: torch's timeout
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=2,
                                    timeout=datetime.timedelta(seconds=1.5))
        waiting.join()
        assert seen and seen[0][0] == "rendezvous" and seen[0][1] > launched, seen
        assert "timeout" in str(raised.value).lower() or "timed out" in str(raised.value).lower(), raised.value
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        try:
            assert phase()[0] == "first_step"
            run_steps(m, 1, loss=1.0)
            assert phase()[0] == "training"
        finally:
            dist.destroy_process_group()
    finally:
        m.close()
    assert dist.init_process_group is original


def test_a_checkpoint_block_is_known_while_it_runs_and_cleared_after(monitor):
    """The block's start is in the rank's files while it runs (the exporter reads the rank as busy,
    its peers in a barrier as waiting for it), 0 once it ends, also when the save raises."""
    block = ("rankscope_block_started_timestamp_seconds", "checkpoint_save")
    before = time.time()
    with monitor.checkpoint("save"):
        inside = published(monitor)
        assert before <= inside[block] <= time.time()
        assert inside[("rankscope_block_started_timestamp_seconds", "evaluation")] == 0.0
    after = published(monitor)
    assert after[block] == 0.0 and after[("rankscope_block_ended_timestamp_seconds",)] >= inside[block]
    with pytest.raises(OSError):
        with monitor.evaluation():
            raise OSError("disk full")
    assert published(monitor)[("rankscope_block_started_timestamp_seconds", "evaluation")] == 0.0
