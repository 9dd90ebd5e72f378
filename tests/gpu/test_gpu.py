"""GPU checks, run as one command on a machine with one NVIDIA GPU (bash tests/gpu/run.sh):

    python -m pytest tests/gpu -m gpu -s -q

Skipped cleanly where torch sees no CUDA device. Each check prints its figures and
adds them to $GPU_CHECK_OUT (JSON) when that is set; docs/performance.md ("On a GPU")
keeps the last run's. What they prove:

1. NCCL all-reduce durations (CUDA events, read lazily) against an independent
   clock: the kernels' own start and end as CUPTI records them (torch.profiler),
   and the host's wall clock over back-to-back calls.
2. A full instrumented DDP step (the comm hook, phases, loss, a list of grad norms
   and the lr as device tensors, the publisher's memory reads) adds no host-device
   sync: sync-debug mode set to "error" (which sees cudaStreamSynchronize and
   synchronising copies) plus counts of the calls it cannot see
   (cudaEventSynchronize, torch.cuda.synchronize, .item()), on every thread, and
   zero telemetry errors and drops afterwards. With ``Monitor(device=...)`` and
   with ``Monitor()``, which learns its device from the model.
3. The default configuration's overhead against a bare GPU DDP step, interleaved
   block by block, as a ratio with its 95% interval.
4. The DDP comm hook trains to the same weights as DDP without it, bit for bit.
5. NVML readings through the exporter's collector against ``nvidia-smi``.
6. FSDP2 and explicit collectives on NCCL, counted from ProcessGroupNCCL's own
   flight recorder, equal CommDebugMode's counts; the hang dump writes that
   recorder.
7. MFU with the device's peak from its NVML name; allocator figures against
   ``torch.cuda.memory_stats()``.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import statistics
import subprocess
import threading
import time
from contextlib import contextmanager

import pytest
import torch

from tests.gpu.figures import record
from tests.helpers.tiny_models import faults as telemetry_faults

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

DEVICE = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def nccl_group(tmp_path_factory):
    import torch.distributed as dist

    from tests.helpers.jobs import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      RANKSCOPE_METRICS_DIR=str(tmp_path_factory.mktemp("metrics")), RANKSCOPE_EXPORTER="off")
    # The training thread's current device is left as it is: rankscope must not depend on set_device.
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=DEVICE)
    yield dist
    dist.destroy_process_group()


@contextmanager
def open_monitor(**options):
    from rankscope.monitor import Monitor

    options.setdefault("run", "gpu-check")
    options.setdefault("publish_interval_s", 0.05)
    m = Monitor(**options)
    try:
        yield m
    finally:
        m.close()


def model_1k() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).to(DEVICE)


@contextmanager
def no_sync_allowed():
    """Sync-debug mode "error", and counts (every thread) of the syncs it cannot see."""
    counts = {"Event.synchronize": 0, "Stream.synchronize": 0, "cuda.synchronize": 0, "Tensor.item": 0}
    originals = {"Event.synchronize": (torch.cuda.Event, "synchronize"),
                 "Stream.synchronize": (torch.cuda.Stream, "synchronize"),
                 "cuda.synchronize": (torch.cuda, "synchronize"), "Tensor.item": (torch.Tensor, "item")}
    saved = {k: getattr(owner, attr) for k, (owner, attr) in originals.items()}

    def counting(key):
        original = saved[key]

        def call(*args, **kwargs):
            # .item() syncs only on a device tensor (the publisher reads pinned host buffers)
            if key != "Tensor.item" or getattr(args[0], "is_cuda", False):
                counts[key] += 1
            return original(*args, **kwargs)

        return call

    for key, (owner, attr) in originals.items():
        setattr(owner, attr, counting(key))
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield counts
    finally:
        torch.cuda.set_sync_debug_mode("default")
        for key, (owner, attr) in originals.items():
            setattr(owner, attr, saved[key])


def instrumented_step(monitor, model, opt, x, y, lr=None, gauge=None) -> None:
    """``lr``: a device tensor to observe instead of the optimizer's float; ``gauge``: a user
    gauge set from a device tensor each step."""
    with monitor.step(samples=len(x)) as step:
        with step.phase("forward"):
            loss = torch.nn.functional.mse_loss(model(x), y)
        with step.phase("backward"):
            loss.backward()
        with step.phase("optimizer"):
            norms = [p.grad.norm() for p in model.parameters()]   # a list of device norms, as per-group clipping gives
            opt.step()
            opt.zero_grad(set_to_none=True)
        step.observe(loss=loss, grad_norm=norms, lr=opt.param_groups[0]["lr"] if lr is None else lr)
    if gauge is not None:
        gauge.set(loss.detach() * 2)


# -- 1. collective durations against an independent clock -----------------------------------

def test_collective_durations_against_an_independent_clock(nccl_group):
    """Out-of-place all-gathers: at world size 1 NCCL's in-place all-reduce does no device work
    (ncclLaunchOneRank copies only out of place), so an all-reduce would compare nothing. An
    out-of-place all-gather is a device-to-device copy of the input: CUPTI records it (a memcpy
    or an NCCL kernel), and the host clock over back-to-back calls sees it."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    dist = nccl_group
    rows = []
    with open_monitor(device=DEVICE, backend="nccl") as monitor:
        for numel in (1 << 12, 1 << 20, 1 << 24, 1 << 26, 1 << 27):   # 16 KiB .. 512 MiB of float32
            inp, out = torch.ones(numel, device=DEVICE), torch.empty(numel, device=DEVICE)
            for _ in range(3):
                dist.all_gather_into_tensor(out, inp)
            torch.cuda.synchronize()
            monitor.parts.tracker.poll_device()
            monitor.parts.tracker.drain()
            n = 20
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                torch.cuda.synchronize()
                host_start = time.perf_counter()
                for _ in range(n):
                    with monitor.collective("all_gather", out):
                        dist.all_gather_into_tensor(out, inp)
                torch.cuda.synchronize()
                host_per_call = (time.perf_counter() - host_start) / n
            with monitor.parts.device.on_device():
                monitor.parts.tracker.poll_device()
            recorded = [r.duration for r in monitor.parts.tracker.drain()]
            device_work = [e for e in prof.events() if e.device_type == DeviceType.CUDA
                           and ("nccl" in e.name.lower() or "memcpy" in e.name.lower())]
            spans = [e.time_range.elapsed_us() / 1e6 for e in device_work]
            assert len(recorded) == n, (numel, len(recorded))
            kernel = statistics.median(spans) if spans else math.nan
            rankscope = statistics.median(recorded)
            rows.append({"bytes": numel * 4, "rankscope_us": rankscope * 1e6, "device_work_us": kernel * 1e6,
                         "device_work_seen": len(spans), "names": sorted({e.name for e in device_work})[:3],
                         "host_per_call_us": host_per_call * 1e6,
                         "ratio_to_device_work": rankscope / kernel if spans else None,
                         "ratio_to_host": statistics.fmean(recorded) / host_per_call,
                         "compared": host_per_call * 1e6 >= 100})
    record("all_gather_timing", rows)
    compared = [row for row in rows if row["compared"]]
    assert compared, rows   # at least one size did real device work: the check compared something
    for row in compared:
        assert 0.85 <= row["ratio_to_host"] <= 1.15, row
        assert row["device_work_seen"], row
        assert 0.9 <= row["ratio_to_device_work"] <= 1.3, row


# -- 2. a full instrumented DDP step: no sync, no telemetry fault ---------------------------

@pytest.mark.parametrize("device_given", ["cuda:0", "cuda", None],
                         ids=["Monitor(device=cuda:0)", "Monitor(device=cuda)", "Monitor()"])
def test_an_instrumented_ddp_step_adds_no_sync(nccl_group, device_given):
    """With the device given, given without an index (resolved at the first step: a Monitor made
    before set_device), and learnt from the model; a CUDA lr and a user gauge set from a device
    tensor each step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    options = {"device": device_given} if device_given else {}
    with open_monitor(backend="nccl", memory_every_s=0.05, **options) as monitor:
        model = monitor.watch(DDP(model_1k(), device_ids=[0]))
        assert monitor.parts.device.cuda and monitor.parts.device.index == 0   # Monitor(): learnt from the model
        assert monitor.parts.watched.comm.mode == "hook"                          # comm_timing=auto on CUDA
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x, y = torch.randn(256, 1024, device=DEVICE), torch.randn(256, 1024, device=DEVICE)
        lr = torch.full((), 1e-3, device=DEVICE)        # a scheduler's lr kept on the device
        gauge = monitor.gauge("doubled_loss", "The loss, doubled")
        for _ in range(2):   # DDP's first steps rebuild buckets and may synchronise: not ours to judge
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        steps = 50
        with no_sync_allowed() as syncs:
            for _ in range(steps):
                instrumented_step(monitor, model, opt, x, y, lr=lr, gauge=gauge)
            time.sleep(0.5)   # the publisher thread reads events, values and memory meanwhile
        torch.cuda.synchronize()
        deadline = time.time() + 5
        while time.time() < deadline and (monitor.parts.device.reads._values or monitor.parts.device.reads._steps):
            time.sleep(0.05)
        monitor.parts.publisher.flush()
        m = monitor.parts.metrics
        phases = {p: c._value.get() for p, c in m.phase.items()}
        timed = sum(b.get() for b in m.collective("all_reduce").duration._buckets)
        figures = {"syncs": dict(syncs), "faults": telemetry_faults(monitor), "steps": m.steps._value.get(),
                   "timed_buckets": timed, "phases_s": phases, "loss": m.observed["loss"]._value.get(),
                   "grad_norm": m.observed["grad_norm"]._value.get(), "lr": m.observed["lr"]._value.get(),
                   "gauge": gauge._children[()]._value.get()}
        record(f"ddp_step_{device_given or 'no_device'}", figures)
        assert sum(syncs.values()) == 0, syncs
        assert figures["faults"] == {}, figures["faults"]
        assert figures["steps"] >= steps and timed >= steps
        assert phases["forward"] > 0 and phases["backward"] + phases["comm_wait"] > 0 and phases["optimizer"] > 0
        assert figures["loss"] > 0 and figures["grad_norm"] > 0 and figures["lr"] == pytest.approx(1e-3)
        assert figures["gauge"] == pytest.approx(2 * figures["loss"], rel=1e-5)   # the last step's, read later
        info = monitor.parts.registration.info or {}
        assert info.get("device") == "cuda:0" and info.get("gpu_uuid", "").startswith(("GPU-", "MIG-")), info


# -- 3. overhead of the default configuration ------------------------------------------------

def test_overhead_of_the_default_configuration_against_a_bare_step(nccl_group):
    """Two DDP copies of one model in one process, one watched; blocks of steps interleaved
    ABBA, each block timed from a synchronised start to a synchronised end (between the
    steps of a block nothing waits for the device, as in training)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.benchmarks.common import mean_ci

    def make():
        torch.manual_seed(0)
        layers = []
        for _ in range(4):
            layers += [torch.nn.Linear(4096, 4096), torch.nn.GELU()]
        return DDP(torch.nn.Sequential(*layers).to(DEVICE), device_ids=[0])

    block, rounds = 10, 60
    with open_monitor(device=DEVICE, backend="nccl", exporter="auto",
                      metrics_port=int(os.environ.get("GPU_CHECK_PORT", "9471"))) as monitor:
        bare, watched = make(), monitor.watch(make())
        opts = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (bare, watched)}
        x, y = torch.randn(512, 4096, device=DEVICE), torch.randn(512, 4096, device=DEVICE)

        def bare_block():
            for _ in range(block):
                loss = torch.nn.functional.mse_loss(bare(x), y)
                loss.backward()
                opts[id(bare)].step()
                opts[id(bare)].zero_grad(set_to_none=True)

        def watched_block():
            for _ in range(block):
                instrumented_step(monitor, watched, opts[id(watched)], x, y)

        def timed(run) -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run()
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) / block

        stop = threading.Event()
        scrapes = [0]

        def scraper():   # Prometheus scraping the node's exporter every second, as in production
            import urllib.request

            while not stop.wait(1.0):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{monitor.config.metrics_port}/metrics", timeout=2).read()
                    scrapes[0] += 1
                except OSError:
                    pass

        for _ in range(3):
            timed(bare_block), timed(watched_block)   # warm-up: allocator, cuBLAS, DDP buckets
        threading.Thread(target=scraper, daemon=True).start()
        bare_s, watched_s = [], []
        for i in range(rounds):
            order = (bare_block, watched_block) if i % 2 == 0 else (watched_block, bare_block)
            for run in order:
                (bare_s if run is bare_block else watched_s).append(timed(run))
        stop.set()
        ratios = [w / b for w, b in zip(watched_s, bare_s)]
        mean, low, high = mean_ci(ratios)
        figures = {"bare_step_ms": statistics.median(bare_s) * 1e3,
                   "instrumented_step_ms": statistics.median(watched_s) * 1e3,
                   "ratio": mean, "ratio_95ci": [low, high], "rounds": rounds, "steps_per_block": block,
                   "scrapes": scrapes[0], "faults": telemetry_faults(monitor)}
    record("overhead_default_config", figures)   # a figure to report, not a timed assertion
    assert figures["faults"] == {}


# -- 4. same weights ----------------------------------------------------------------------------

def test_the_comm_hook_trains_to_the_same_weights_on_nccl(nccl_group):
    from torch.nn.parallel import DistributedDataParallel as DDP

    with open_monitor(device=DEVICE, backend="nccl", comm_timing="hook") as monitor:
        bare = DDP(model_1k(), device_ids=[0], bucket_cap_mb=1)
        watched = monitor.watch(DDP(model_1k(), device_ids=[0], bucket_cap_mb=1))
        opts = [torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9) for m in (bare, watched)]
        g = torch.Generator(device=DEVICE).manual_seed(1)
        for _ in range(5):
            x = torch.randn(64, 1024, device=DEVICE, generator=g)
            y = torch.randn(64, 1024, device=DEVICE, generator=g)
            for model, opt in zip((bare, watched), opts):
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        equal = all(torch.equal(a, b) for a, b in zip(bare.parameters(), watched.parameters()))
    record("same_weights_nccl_hook", equal)
    assert equal


# -- 5. NVML against nvidia-smi -----------------------------------------------------------------

def test_nvml_readings_against_nvidia_smi():
    from rankscope.exporter.nvml import NvmlCollector

    fields = "uuid,name,memory.total,memory.used,temperature.gpu,power.draw,clocks.sm,power.limit"
    smi = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout.strip().splitlines()[0]
    uuid, name, mem_total, mem_used, temp, power, sm_clock, power_limit = [v.strip() for v in smi.split(",")]
    collector = NvmlCollector(node="gpu-node")
    assert collector.available, collector.error
    samples = {s.name: s for family in collector.collect() for s in family.samples if s.labels.get("gpu") == "0"}
    ours = {
        "uuid": samples["rankscope_gpu_info"].labels["uuid"], "name": samples["rankscope_gpu_info"].labels["name"],
        "memory_total_mib": samples["rankscope_gpu_memory_total_bytes"].value / 2**20,
        "memory_used_mib": samples["rankscope_gpu_memory_used_bytes"].value / 2**20,
        "temperature_c": samples["rankscope_gpu_temperature_celsius"].value,
        "power_w": samples["rankscope_gpu_power_watts"].value,
        "power_limit_w": samples["rankscope_gpu_power_limit_watts"].value,
        "sm_clock_mhz": samples["rankscope_gpu_sm_clock_hertz"].value / 1e6,
    }
    record("nvml_vs_nvidia_smi", {"rankscope": ours, "nvidia_smi": {
        "uuid": uuid, "name": name, "memory_total_mib": mem_total, "memory_used_mib": mem_used,
        "temperature_c": temp, "power_w": power, "power_limit_w": power_limit, "sm_clock_mhz": sm_clock}})
    assert ours["uuid"] == uuid and ours["name"] == name
    assert ours["memory_total_mib"] == pytest.approx(float(mem_total), abs=1)
    assert ours["memory_used_mib"] == pytest.approx(float(mem_used), abs=64)
    assert ours["temperature_c"] == pytest.approx(float(temp), abs=3)
    assert ours["power_limit_w"] == pytest.approx(float(power_limit), rel=0.01)
    assert ours["power_w"] == pytest.approx(float(power), rel=0.3, abs=20)   # read a moment apart


def test_the_evidence_gpu_snapshot_of_a_rank_s_gpu():
    """What an evidence capture holds of a stalled rank's GPU (rankscope.exporter.evidence):
    NvmlCollector.snapshot by UUID, on a real GPU; an unknown UUID says so."""
    from rankscope.exporter.nvml import NvmlCollector

    collector = NvmlCollector(node="gpu-node")
    assert collector.available, collector.error
    uuid = next(s.labels["uuid"] for f in collector.collect() for s in f.samples if s.name == "rankscope_gpu_info")
    snap = collector.snapshot(uuid)
    record("evidence_gpu_snapshot", snap)
    assert snap["uuid"] == uuid and snap["gpu"] == 0 and "error" not in snap
    json.dumps(snap)   # it goes into a JSON capture as it is
    assert collector.snapshot("GPU-not-here") == {"uuid": "GPU-not-here", "error": "no GPU of this node has this UUID"}


# -- 6. NCCL collectives from ProcessGroupNCCL's own flight recorder ----------------------------

def test_fsdp2_and_explicit_collectives_are_counted_from_the_nccl_recorder(nccl_group, tmp_path):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode

    from rankscope.collectives.flight_recorder import dump_flight_recorder
    from rankscope.collectives.ring_entries import op_of

    dist = nccl_group
    with open_monitor(device=DEVICE, backend="nccl") as monitor:
        reader = monitor.parts.process_groups
        assert "nccl" in reader.cursors, reader.cursors
        side = dist.new_group([0])   # a sub-group, as tensor or pipeline parallelism creates
        reader._timing = True   # durations too (RANKSCOPE_COLLECTIVE_TIMING=1), on every group from now on
        reader.poll()
        model = model_1k()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        model = monitor.watch(fully_shard(model))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x, y = torch.randn(256, 1024, device=DEVICE), torch.randn(256, 1024, device=DEVICE)

        def counts() -> dict[str, float]:
            reader.poll(final=True)
            out: dict[str, float] = {}
            for (recorder, _), g in reader.groups.items():
                for op, (c, *_) in g.series.items():   # (count, bytes, bus bytes)
                    out[f"{recorder}:{op}"] = out.get(f"{recorder}:{op}", 0) + c._value.get()
            return out

        torch.nn.functional.mse_loss(model(x), y).backward()   # warm-up: lazy init
        opt.step()
        torch.cuda.synchronize()
        before = counts()

        def durations() -> float:
            return sum(sum(b.get() for b in child._buckets) for child in reader._m._durations.values())

        timed_before = durations()
        expected: dict[str, int] = {}
        fsdp2_own: dict[str, int] = {}

        def add(into: dict[str, int], cdm) -> None:
            for op, n in cdm.get_comm_counts().items():
                key = "nccl:" + op_of("cdm:" + str(op).split(".")[-1])
                into[key] = into.get(key, 0) + n

        with no_sync_allowed() as syncs:
            for _ in range(10):
                with CommDebugMode() as step_cdm:
                    with monitor.step(samples=256) as step:
                        with step.phase("forward"):
                            loss = torch.nn.functional.mse_loss(model(x), y)
                        with step.phase("backward"):
                            loss.backward()
                        with step.phase("optimizer"):
                            opt.step()
                            opt.zero_grad(set_to_none=True)
                with CommDebugMode() as side_cdm:
                    out = torch.empty(2048, device=DEVICE)
                    dist.all_gather_into_tensor(out, torch.ones(2048, device=DEVICE), group=side)
                    dist.reduce_scatter_tensor(torch.empty(2048, device=DEVICE), out, group=side)
                add(fsdp2_own, step_cdm)
                add(expected, step_cdm)
                add(expected, side_cdm)
                reader.poll()   # the reader's work must not synchronise either
        torch.cuda.synchronize()
        # Read at once: the newest entries are completed in the read's copy of the ring but not yet
        # retired by NCCL's watchdog, which writes their durations; each must get it later.
        after = counts()
        pending_at_once = len(reader.cursors["nccl"].pending_duration)
        t0 = time.perf_counter()
        while reader.cursors["nccl"].pending_duration and time.perf_counter() - t0 < 15:
            time.sleep(0.2)
            counts()
        waited_s = time.perf_counter() - t0
        seen = {op: after[op] - before.get(op, 0) for op in after if after[op] - before.get(op, 0)}
        timed = durations() - timed_before
        dumps = dump_flight_recorder(tmp_path, 0)
        dumped = pickle.loads(dumps[0].read_bytes()) if dumps else {}
        nccl_entries = [e for e in dumped.get("entries", []) if str(e.get("profiling_name", "")).startswith("nccl:")]
        record("fsdp2_nccl_recorder", {
            "rankscope": seen, "CommDebugMode": expected, "fsdp2_own_collectives": fsdp2_own,
            "fsdp2_note": ("FSDP2 issued no collective of its own at world size 1 (torch skips them): its "
                           "counting is shown only by a job on 2+ GPUs" if not fsdp2_own else "FSDP2's own counted"),
            "durations": timed,
            "pending_durations_right_after_synchronize": pending_at_once, "waited_for_retirement_s": waited_s,
            "syncs": dict(syncs), "dump": [p.name for p in dumps], "dump_nccl_entries": len(nccl_entries)})
    assert expected.get("nccl:all_gather", 0) >= 10 and expected.get("nccl:reduce_scatter", 0) >= 10, expected
    assert seen == expected, (seen, expected)
    assert sum(syncs.values()) == 0, syncs
    assert not reader.cursors["nccl"].pending_duration          # every entry read was retired meanwhile
    assert timed >= sum(expected.values()), (timed, expected)    # ... each with its duration
    assert dumps and dumps[0].name == "nccl_trace_rank_0" and nccl_entries


# -- 7. MFU and allocator figures --------------------------------------------------------------

def test_mfu_from_the_nvml_name_and_allocator_figures(nccl_group):
    from rankscope.flops import FlopsConfig, lookup_peak_flops

    name = torch.cuda.get_device_name(0)
    batch, width = 512, 4096
    per_sample = 6 * (2 * width * width)   # two linear layers, forward and backward
    flops = FlopsConfig(flops_per_sample=per_sample, dtype="bf16")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width, bias=False), torch.nn.Linear(width, width, bias=False))
    model = model.to(DEVICE, torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(batch, width, device=DEVICE, dtype=torch.bfloat16)
    with open_monitor(device=DEVICE, backend="nccl", flops=flops, memory_every_s=0.05) as monitor:
        for _ in range(3):
            model(x).float().square().mean().backward()
        torch.cuda.synchronize()
        steps = 100
        t0 = time.perf_counter()
        for _ in range(steps):
            with monitor.step(samples=batch):
                model(x).float().square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        monitor.parts.publisher._last_memory = 0.0
        monitor.parts.publisher.flush()
        stats = torch.cuda.memory_stats(0)
        m = monitor.parts.metrics
        peak = m.peak_flops._value.get() if m.peak_flops is not None else None
        model_flops = m.model_flops._value.get()
        figures = {
            "nvml_name": name, "peak_flops": peak, "table_peak": lookup_peak_flops(name, "bf16"),
            "mfu": model_flops / elapsed / peak if peak else None,
            "allocated": [m.mem_allocated._value.get(), stats["allocated_bytes.all.current"]],
            "reserved": [m.mem_reserved._value.get(), stats["reserved_bytes.all.current"]],
            "peak_allocated": [m.mem_peak._value.get(), stats["allocated_bytes.all.peak"]],
            "device_memory_total": [m.mem_total._value.get(), torch.cuda.get_device_properties(0).total_memory],
        }
    record("mfu_and_allocator", figures)
    assert peak is not None and peak == figures["table_peak"], figures
    assert 0.05 < figures["mfu"] < 1.0, figures
    assert model_flops == pytest.approx(per_sample * batch * steps)
    for key in ("allocated", "reserved", "peak_allocated", "device_memory_total"):
        assert figures[key][0] == figures[key][1], (key, figures[key])
