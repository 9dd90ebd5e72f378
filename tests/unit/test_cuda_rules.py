"""The Monitor's CUDA paths against a strict double of its CUDA boundary (tests/helpers/strict_cuda.py).

No GPU here: the double takes every tensor for one on the rank's GPU (cuda:1, as for the
second rank of a node whose ranks all see every GPU) and fails a test when rankscope
touches another device, touches one from a thread that never set it, waits for the device
on the training thread, or records an event on another device's stream. Each test names
the defect it caught before its fix (issue 44's findings).
"""

from __future__ import annotations

import http.server
import socketserver
import threading

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from rankscope.collectives.group_reader import ProcessGroupReader
from rankscope.collectives.ring_source import FlightRecorderSource
from rankscope.device.rank_device import RankDevice
from tests.helpers.jobs import free_port
from tests.helpers.strict_cuda import StrictCuda, in_thread
from tests.helpers.tiny_models import faults
from tests.unit.collectives.fakes import FakeRecorder, Sink

RANK_GPU = 1


@pytest.fixture
def gloo_world():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def monitor_env(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    return dict(exporter="off", metrics_dir=tmp_path, publish_interval_s=60, max_process_groups=0)


def publish(monitor) -> None:
    """One publish on the publisher's own thread, as it runs every interval."""
    assert monitor.parts.handoff.publish_now.ask(timeout_s=10.0)


def train(monitor, model, steps: int = 3, gauge=None) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for i in range(steps):
        x, y = torch.randn(8, 4), torch.randn(8, 2)
        with monitor.step(samples=8) as step:
            with step.phase("forward"):
                loss = torch.nn.functional.mse_loss(model(x), y)
            with step.phase("backward"):
                loss.backward()
            with step.phase("optimizer"):
                norms = [p.grad.norm() for p in model.parameters()]
                opt.step()
                opt.zero_grad()
            step.observe(loss=loss.detach(), grad_norm=norms, lr=torch.tensor(0.1))
        if gauge is not None:
            gauge.set(loss.detach() * 2)
        losses.append(float(loss.detach()))   # the test's own read, not rankscope's
    return losses


def test_a_ddp_job_on_its_rank_gpu_touches_no_other_device_and_never_waits(gloo_world, monitor_env):
    """Findings 1 and 5: the publisher thread queried events with no device set (a context on GPU 0
    in every rank of a node); a user gauge set from a device tensor read it with .item() on the
    training thread."""
    from rankscope.monitor import Monitor

    with StrictCuda(rank_device=RANK_GPU) as cuda:
        cuda.set_device(RANK_GPU)
        monitor = Monitor(device=f"cuda:{RANK_GPU}", comm_timing="hook", run="strict-ddp", **monitor_env)
        try:
            model = monitor.watch(DDP(torch.nn.Linear(4, 2)))
            gauge = monitor.gauge("doubled_loss", "The loss, doubled")
            losses = train(monitor, model, gauge=gauge)
            publish(monitor)
            m = monitor.parts.metrics
            assert m.observed["loss"]._value.get() == pytest.approx(losses[-1], rel=1e-6)
            assert m.observed["lr"]._value.get() == pytest.approx(0.1)
            assert m.observed["grad_norm"]._value.get() > 0
            assert m.collective("all_reduce").duration._sum.get() > 0      # every bucket timed by events
            assert sum(m.phase[p]._value.get() for p in ("forward", "backward", "optimizer")) > 0
            assert gauge._children[()]._value.get() == pytest.approx(2 * losses[-1], rel=1e-6)
            assert {thread for thread, _ in cuda.touched} == {"rankscope-publisher"}
            assert faults(monitor) == {}
        finally:
            monitor.close()


def test_a_monitor_made_before_set_device_times_the_device_set_after(monitor_env):
    """Finding 3: Monitor(device="cuda") before torch.cuda.set_device stayed on cuda:0: every
    loss dropped, phases timed on GPU 0's idle stream."""
    from rankscope.monitor import Monitor

    with StrictCuda(rank_device=RANK_GPU) as cuda:
        monitor = Monitor(device="cuda", run="strict-late-device", **monitor_env)
        try:
            cuda.set_device(RANK_GPU)   # the loop sets its device after making the monitor
            losses = train(monitor, torch.nn.Linear(4, 2))
            publish(monitor)
            assert monitor.parts.device.index == RANK_GPU
            assert monitor.parts.metrics.observed["loss"]._value.get() == pytest.approx(losses[-1], rel=1e-6)
            assert faults(monitor) == {}
        finally:
            monitor.close()


def test_a_bucket_whose_end_event_fails_does_not_stall_the_device_phases(gloo_world, monitor_env):
    """Finding 7: one failed end-of-bucket record left its step waiting for a duration that never
    came; every later step piled up behind it (and the all-reduce stayed "in flight")."""
    from rankscope.monitor import Monitor

    with StrictCuda(rank_device=RANK_GPU) as cuda:
        cuda.set_device(RANK_GPU)
        monitor = Monitor(device=f"cuda:{RANK_GPU}", comm_timing="hook", run="strict-bucket", **monitor_env)
        try:
            model = monitor.watch(DDP(torch.nn.Linear(4, 2)))
            cuda.fail_records_in = "end_device"
            train(monitor, model, steps=1)
            cuda.fail_records_in = ""
            train(monitor, model, steps=2)
            publish(monitor)
            assert not monitor.parts.device.reads._steps                        # every step's phases were read
            assert monitor.parts.tracker.in_flight() == {}
            assert monitor.parts.metrics.phase["forward"]._value.get() > 0
            assert faults(monitor) == {"error:collectives": 1.0}                 # the one failure, counted
        finally:
            monitor.close()


def test_ddp_with_the_python_reducer_gets_no_hook_and_trains_the_same(gloo_world, monitor_env, monkeypatch):
    """Finding 6: compiled autograd's python reducer calls comm hooks as hook(state, (grad, param)):
    the timing hook raised inside backward."""
    import torch._dynamo

    from rankscope.monitor import Monitor

    monkeypatch.setattr(torch._dynamo.config, "optimize_ddp", "python_reducer")

    def run(watch: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(4, 2))
        assert model._use_python_reducer
        if watch:
            monitor = Monitor(comm_timing="hook", run="strict-python-reducer", **monitor_env)
            model = monitor.watch(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            torch.nn.functional.mse_loss(model(torch.ones(8, 4)), torch.zeros(8, 2)).backward()
            opt.step()
            opt.zero_grad()
        if watch:
            assert monitor.parts.watched.comm.mode == "off"
            monitor.close()
        return [p.detach().clone() for p in model.parameters()]

    bare, watched = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(bare, watched))


class _FakeC10d:
    """torch._C._distributed_c10d's flight-recorder calls, over a FakeRecorder whose NCCL reads
    query CUDA events on the calling thread (as FlightRecorderDetail's update_state does)."""

    def __init__(self, cuda: StrictCuda, nccl: FakeRecorder, cpu: FakeRecorder):
        self.cuda, self.nccl, self.cpu = cuda, nccl, cpu
        c10d = self

        class WorkerServer:
            """torch's worker server: a C++ thread of torch's, whose current device is CUDA's default, 0."""

            def __init__(self, path: str):
                class Handler(http.server.BaseHTTPRequestHandler):
                    def do_POST(self):
                        body = c10d._dump_nccl_trace_json(True, False) if "nccl" in self.path else \
                            c10d._dump_fr_trace_json(True, False)
                        self.send_response(200)
                        self.send_header("Content-Length", str(len(body)))
                        self.end_headers()
                        self.wfile.write(body)

                    def log_message(self, *args):
                        pass

                self.server = socketserver.UnixStreamServer(path, Handler)
                self.thread = threading.Thread(target=self._serve, name="torch-worker-server", daemon=True)
                self.thread.start()

            def _serve(self):
                c10d.cuda.set_device(0)
                self.server.serve_forever(poll_interval=0.05)

            def shutdown(self):
                self.server.shutdown()
                self.server.server_close()

        self._WorkerServer = WorkerServer

    def _dump_nccl_trace_json(self, include_collectives: bool, only_active: bool) -> bytes:
        self.cuda.touch("NCCL's flight recorder (cudaEventQuery of unretired collectives)")
        return self.nccl.entries_json()

    def _dump_fr_trace_json(self, include_collectives: bool, only_active: bool) -> bytes:
        return self.cpu.entries_json()


@pytest.mark.parametrize("rank_gpu", [0, RANK_GPU])
def test_the_nccl_flight_recorder_is_read_with_the_rank_device_current(tmp_path, rank_gpu):
    """Finding 1 (torch's thread): fetched from torch's worker server, NCCL's ring was serialised
    on a thread of torch's whose current device is 0, querying the events of unretired
    collectives there: a context on GPU 0 for every rank whose GPU is not 0."""
    with StrictCuda(rank_device=rank_gpu) as cuda:
        nccl, cpu = FakeRecorder(), FakeRecorder()
        for _ in range(3):
            nccl.collective(op="nccl:all_reduce", duration_ms=1.0, time_discovered_completed_ns=1)
        c10d = _FakeC10d(cuda, nccl, cpu)
        device = RankDevice(lambda what, reason: None)
        source = FlightRecorderSource(tmp_path, 0, recorders=("cpu", "nccl"), device=device, c10d=c10d)
        sink = Sink()
        reader = ProcessGroupReader(sink, lambda *a, **k: None, lambda: pytest.fail("reader error"), source, 8, 60.0,
                                    entries_every_s=0.0, initialized=lambda: True)
        try:
            in_thread(reader.poll, name="rankscope-process-groups")   # no device known: NCCL's waits
            assert ("count", "default", "0", "all_reduce") not in sink.children
            device.bind(f"cuda:{rank_gpu}")
            in_thread(reader.poll, name="rankscope-process-groups")
            assert sink.children[("count", "default", "0", "all_reduce")].value == 3
            assert sink.children[("duration", "default", "all_reduce")].observed == [0.001] * 3
            served = {thread for thread, _ in cuda.touched} - {"rankscope-process-groups"}
            assert served == ({"torch-worker-server"} if rank_gpu == 0 else set())
        finally:
            source.close()
