"""Issue 2: a real 2-rank torchrun job of the reference trainer, scraped live
through the node exporter it starts."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import time

import pytest

from rankscope.exporter.catalog import RANK_STATES
from tests.helpers.jobs import TrainJob, select, value
from rankscope.contract import catalog

RANKS = ("0", "1")
# Rank series every rank must export, by base name (histograms via _count).
EXPECTED = [spec.name + ("_count" if spec.kind == "histogram" else "") for spec in catalog.RANK_METRICS
            if not spec.name.startswith("rankscope_device_memory_")  # CUDA allocator: not on a CPU run...
            # gloo measures no collective durations (NCCL with collective timing does), and an
            # op's in-flight start appears once a read finds one of its collectives in flight
            and spec.name not in ("rankscope_process_group_collective_duration_seconds",
                                  "rankscope_process_group_in_flight_started_timestamp_seconds",
                                  # a CPU has no peak FLOPS, so no MFU (docs/goodput.md)
                                  "rankscope_device_peak_flops")
            ] + ["rankscope_device_memory_total_bytes",               # ...except the device total (0 on CPU)
                 "rankscope_rank_up", "rankscope_rank_state", "rankscope_hang_suspect"]


def ddp_buckets_per_step(bucket_cap_mb: float = 0.1, hidden: int = 256) -> tuple[int, int]:
    """Bucket count and gradient bytes per step of the trainer's model, measured
    independently of rankscope: a 1-process gloo group with a hook that only counts."""
    script = f"""
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from rankscope.reference.model import IN_FEATURES, build_model
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{_port()}", rank=0, world_size=1)
model = DDP(build_model({hidden}), bucket_cap_mb={bucket_cap_mb})
seen = dict()
def hook(state, bucket):
    seen[bucket.index()] = bucket.buffer().numel() * bucket.buffer().element_size()
    return allreduce_hook(state, bucket)
model.register_comm_hook(None, hook)
for step in range(3):  # DDP rebuilds its buckets after the first step
    seen.clear()
    model(torch.randn(8, IN_FEATURES)).sum().backward()
print(len(seen), sum(seen.values()))
"""
    out = subprocess.run([os.sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    buckets, nbytes = out.stdout.strip().splitlines()[-1].split()
    return int(buckets), int(nbytes)


def _port() -> int:
    from tests.helpers.jobs import free_port

    return free_port()


@pytest.mark.parametrize("comm_timing", ["auto", "hook"])
def test_live_metrics_of_a_two_rank_job(comm_timing):
    """auto is DDP's own timers on CPU (one all-reduce timing per 10 steps);
    hook times every bucket of every step."""
    steps = 300
    buckets, bucket_bytes = ddp_buckets_per_step()
    assert buckets >= 2, "the reference model should have several DDP buckets"
    with TrainJob(nproc=2, steps=steps, extra_args=["--step-delay", "0.02", "--eval-every", "50"],
                  env={"RANKSCOPE_COMM_TIMING": comm_timing}) as job:
        first = job.wait_for(lambda s: all((value(s, "rankscope_steps_total", rank=r) or 0) >= 3 for r in RANKS)
                             and s, timeout=90, what="first steps of both ranks")
        early_loss = {r: value(first, "rankscope_loss", rank=r) for r in RANKS}
        second = job.wait_for(lambda s: all(value(s, "rankscope_steps_total", rank=r) >
                                            value(first, "rankscope_steps_total", rank=r) for r in RANKS) and s,
                              timeout=30, what="steps to increase between scrapes")
        # Every listed series exists for both ranks while the job runs.
        for r in RANKS:
            for name in EXPECTED:
                assert select(second, name, rank=r), f"rank {r}: no {name}"
            assert value(second, "rankscope_rank_state", rank=r, state="progressing") == 1
            assert value(second, "rankscope_rank_up", rank=r) == 1
            assert len(select(second, "rankscope_phase_seconds_total", rank=r)) == len(catalog.PHASES)
            info = select(second, "rankscope_rank_info", rank=r)
            assert len(info) == 1 and info[0].labels["world_size"] == "2" and info[0].labels["backend"] == "gloo"
            assert info[0].labels["process_id"] == str(job.rank_pids()[int(r)])
            assert (value(second, "rankscope_heartbeat_timestamp_seconds", rank=r) or 0) > time.time() - 5
            assert value(second, "rankscope_host_memory_rss_bytes", rank=r) > 50e6
            # The trainer gives its FLOPs per sample, but a CPU has no peak: FLOPs counted, no MFU.
            assert value(second, "rankscope_model_flops_total", rank=r) > 0
            assert not select(second, "rankscope_device_peak_flops", rank=r)
        assert job.wait(timeout=180) == 0, job.log()[-2000:]
        final = job.wait_for(lambda s: all(value(s, "rankscope_rank_state", rank=r, state="finished") == 1
                                           for r in RANKS) and s, timeout=15, what="ranks finished")
        for r in RANKS:
            taken = value(final, "rankscope_steps_total", rank=r)
            assert taken == steps
            assert value(final, "rankscope_step_duration_seconds_count", rank=r) == steps
            assert value(final, "rankscope_step", rank=r) == steps - 1
            step_seconds = value(final, "rankscope_step_duration_seconds_sum", rank=r)
            phase_seconds = sum(s.value for s in select(final, "rankscope_phase_seconds_total", rank=r))
            assert abs(phase_seconds - step_seconds) <= 0.10 * step_seconds, (phase_seconds, step_seconds)
            assert value(final, "rankscope_samples_total", rank=r) == steps * 64
            final_loss = value(final, "rankscope_loss_ema", rank=r)
            assert math.isfinite(final_loss) and final_loss < early_loss[r], (early_loss[r], final_loss)
            allreduce = value(final, "rankscope_collective_duration_seconds_count", rank=r, op="all_reduce")
            all_bytes = value(final, "rankscope_collective_bytes_total", rank=r, op="all_reduce")
            if comm_timing == "hook":
                assert allreduce >= steps * buckets - buckets, (allreduce, steps, buckets)  # step 0: before rebuild
                timed_steps = steps
            else:
                timed_steps = allreduce - steps // 50   # less the evaluations' explicit all-reduces
                assert timed_steps >= steps // 10 - 2, (allreduce, steps)
            # Bytes of the timed steps' gradients, plus the evaluations' small all-reduces.
            assert timed_steps * bucket_bytes <= all_bytes <= timed_steps * bucket_bytes * 1.01, \
                (all_bytes, timed_steps, bucket_bytes)
            # 2 ranks: a ring all_reduce moves each byte 2(n-1)/n = 1 time over the bus.
            assert value(final, "rankscope_collective_bus_bytes_total", rank=r, op="all_reduce") == all_bytes
            assert value(final, "rankscope_collective_last_duration_seconds", rank=r, op="all_reduce") > 0
            assert 0 < value(final, "rankscope_user_eval_accuracy_ratio", rank=r) <= 1
            assert value(final, "rankscope_nonfinite_total", rank=r, what="loss") == 0
            # A finished rank is in no collective: its live gauges are gone.
            assert not select(final, "rankscope_heartbeat_timestamp_seconds", rank=r)


def test_promtool_finds_no_lint_problem_in_a_real_scrape():
    from tests.helpers.jobs import scrape_text

    with TrainJob(nproc=2, steps=100) as job:
        job.wait_for(lambda s: (value(s, "rankscope_steps_total", rank="1") or 0) > 5, timeout=90)
        text = scrape_text(job.url)
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), \
        result.stdout + result.stderr


def test_killed_rank_is_reported_down_and_the_exporter_outlives_the_job():
    with TrainJob(nproc=2, steps=100_000, extra_args=["--step-delay", "0.01"]) as job:
        # Both ranks must have published: torchrun's SIGTERM ends rank 0 without
        # a last publish (docs/reliability.md), so later steps may not show.
        job.wait_for(lambda s: all((value(s, "rankscope_steps_total", rank=r) or 0) > 5 for r in ("0", "1")),
                     timeout=90)
        pids = job.rank_pids()
        os.kill(pids[1], signal.SIGKILL)
        killed_at = time.monotonic()
        job.wait_for(lambda s: value(s, "rankscope_rank_up", rank="1") == 0, timeout=5, what="rank 1 down")
        reported = time.monotonic() - killed_at
        print(f"rank 1 reported down {reported:.2f} s after SIGKILL")
        assert reported <= 5
        # torchrun tears the job down; the exporter keeps serving every rank.
        job.wait(timeout=60)
        samples = job.wait_for(lambda s: value(s, "rankscope_rank_state", rank="0", state="dead") == 1 and s,
                               timeout=15, what="rank 0 dead after teardown")
        assert value(samples, "rankscope_rank_state", rank="1", state="dead") == 1
        for r in ("0", "1"):
            assert value(samples, "rankscope_steps_total", rank=r) > 5     # counters kept
            assert sum(s.value for s in select(samples, "rankscope_rank_state", rank=r)) == 1
            assert {s.labels["state"] for s in select(samples, "rankscope_rank_state", rank=r)} == set(RANK_STATES)
