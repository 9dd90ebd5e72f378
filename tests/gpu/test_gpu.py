"""GPU checks, run as one script on a machine with an NVIDIA GPU:

    python -m pytest tests/gpu -m gpu -s -q

Skipped cleanly where torch sees no CUDA device. What they prove:
1. A one-GPU NCCL process group: explicit all_reduce of several sizes timed
   through Monitor.collective (CUDA events, read lazily) agrees with CUDA-event
   ground truth recorded around the same calls.
2. A full instrumented DDP step (comm hook, phases, loss and grad norm as
   device tensors, memory sampling by the publisher) runs under
   torch.cuda.set_sync_debug_mode("error"): rankscope adds no host-device sync.
3. NVML readings of the device through the exporter's collector are sane.
4. FSDP2 on NCCL: the all-gathers and reduce-scatters rankscope reads from
   torch's flight recorder equal CommDebugMode's counts for the same steps,
   and with the group's collective timing on each has a device duration
   (rankscope_process_group_collective_duration_seconds), with no added sync.
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]


@pytest.fixture(scope="module")
def nccl_group(tmp_path_factory):
    import torch.distributed as dist

    from tests.helpers.jobs import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      RANKSCOPE_METRICS_DIR=str(tmp_path_factory.mktemp("metrics")), RANKSCOPE_EXPORTER="off")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    yield dist
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def monitor(nccl_group):
    from rankscope.monitor import Monitor

    m = Monitor(device=torch.device("cuda", 0), backend="nccl", run="gpu-check", publish_interval_s=0.2)
    yield m
    m.close()


def test_all_reduce_timing_agrees_with_cuda_events(nccl_group, monitor):
    dist = nccl_group
    rows = []
    for numel in (1 << 10, 1 << 18, 1 << 22, 1 << 26):  # 4 KiB .. 256 MiB of float32
        t = torch.ones(numel, device="cuda")
        for _ in range(3):
            dist.all_reduce(t)
        torch.cuda.synchronize()          # the test may synchronise; rankscope may not
        monitor.tracker.drain()
        truth = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            with monitor.collective("all_reduce", t):
                dist.all_reduce(t)
            end.record()
            truth.append((start, end))
        torch.cuda.synchronize()
        monitor.tracker.poll_device()
        recorded = [r.duration for r in monitor.tracker.drain()]
        expected = [s.elapsed_time(e) / 1000 for s, e in truth]
        assert len(recorded) == len(expected) == 20
        ratio = statistics.median(r / e for r, e in zip(recorded, expected))
        rows.append((numel * 4, statistics.median(recorded) * 1e6, statistics.median(expected) * 1e6, ratio))
        assert 0.8 <= ratio <= 1.25, rows[-1]
    for nbytes, rec, exp, ratio in rows:
        print(f"all_reduce {nbytes:>11} B: rankscope {rec:9.1f} us, CUDA events {exp:9.1f} us, ratio {ratio:.3f}")


def test_instrumented_ddp_step_adds_no_device_sync(nccl_group, monitor):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = monitor.watch(DDP(torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
                                                  torch.nn.Linear(4096, 1024)).cuda(), device_ids=[0]))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(256, 1024, device="cuda"), torch.randn(256, 1024, device="cuda")
    for _ in range(2):   # DDP's first steps rebuild buckets and may synchronise: not ours to judge
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(20):
            with monitor.step(samples=256) as step:
                with step.phase("forward"):
                    loss = torch.nn.functional.mse_loss(model(x), y)
                with step.phase("backward"):
                    loss.backward()
                with step.phase("optimizer"):
                    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                step.observe(loss=loss.detach(), grad_norm=norm.detach(), lr=1e-3)
            monitor.publisher.publish()   # the publisher's work (event queries, memory stats) must not sync either
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    deadline = time.time() + 5
    while time.time() < deadline and monitor.device.reads._values:
        monitor.publisher.publish()
        time.sleep(0.05)
    monitor.publisher.publish()
    m = monitor.metrics
    assert m.steps._value.get() >= 20
    timed = sum(b.get() for b in m.collective("all_reduce").duration._buckets)
    assert timed >= 20      # every bucket of every step timed by CUDA events
    assert m.mem_total._value.get() > 0 and m.mem_peak._value.get() > 0
    assert m.loss._value.get() > 0 and m.nonfinite["loss"]._value.get() == 0


def test_fsdp2_counts_and_durations_from_the_flight_recorder(nccl_group, monitor):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode

    from rankscope.process_groups import op_of

    dist = nccl_group
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).cuda()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    model = monitor.watch(fully_shard(model))
    # Per-collective device durations in the flight recorder: what RANKSCOPE_COLLECTIVE_TIMING=1 turns on
    # (docs/collectives.md: opt-in, it can cost compute/communication overlap under CUDA_DEVICE_MAX_CONNECTIONS=1).
    reader = monitor.process_groups
    reader._timing = True
    reader.poll()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(256, 1024, device="cuda"), torch.randn(256, 1024, device="cuda")

    def counts() -> dict[str, float]:
        reader.poll(final=True)
        return {op: c._value.get() for g in reader.groups.values() for op, (c, _) in g.series.items()}

    torch.nn.functional.mse_loss(model(x), y).backward()   # warm-up: lazy init
    opt.step()
    torch.cuda.synchronize()
    before = counts()
    expected: dict[str, int] = {}
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(10):
            with CommDebugMode() as cdm:
                with monitor.step(samples=256) as step:
                    with step.phase("forward"):
                        loss = torch.nn.functional.mse_loss(model(x), y)
                    with step.phase("backward"):
                        loss.backward()
                    with step.phase("optimizer"):
                        opt.step()
                        opt.zero_grad(set_to_none=True)
            for op, n in cdm.get_comm_counts().items():
                name = op_of("cdm:" + str(op).split(".")[-1])
                expected[name] = expected.get(name, 0) + n
            reader.poll()   # the reader's work must not synchronise either
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    time.sleep(1.0)   # NCCL's watchdog writes durations when it sees the work done
    after = counts()
    seen = {op: after[op] - before.get(op, 0) for op in after if after[op] - before.get(op, 0)}
    assert expected.get("all_gather", 0) > 0 and expected.get("reduce_scatter", 0) > 0, expected
    assert seen == expected, (seen, expected)
    timed = sum(sum(b.get() for b in child._buckets)
                for child in reader._m._durations.values())
    assert timed >= sum(expected.values()) - 2   # the last few may still await the watchdog
    print(f"FSDP2 on NCCL, 10 steps: rankscope {seen}, CommDebugMode {expected}, {timed:.0f} durations")


def test_nvml_readings_are_sane():
    from rankscope.exporter.nvml import NvmlCollector

    collector = NvmlCollector(node="gpu-node")
    assert collector.available, collector.error
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in collector.collect() for s in family.samples}
    by_name: dict[str, list[float]] = {}
    for (name, _), v in samples.items():
        by_name.setdefault(name, []).append(v)
    for name, values in sorted(by_name.items()):
        print(f"{name}: {values[:4]}")
    assert all(0 <= v <= 1 for v in by_name["rankscope_gpu_utilization_ratio"])
    assert all(v > 1e9 for v in by_name["rankscope_gpu_memory_total_bytes"])
    assert all(0 < v < 120 for v in by_name["rankscope_gpu_temperature_celsius"])
    assert all(v > 0 for v in by_name["rankscope_gpu_power_watts"])
    assert all(v > 1e8 for v in by_name["rankscope_gpu_sm_clock_hertz"])
    uuids = {dict(k[1])["uuid"] for k in samples if k[0] == "rankscope_gpu_info"}
    assert all(u.startswith("GPU-") for u in uuids)
