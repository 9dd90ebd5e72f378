"""Accuracy: what rankscope reports (through the node exporter) against
independent measurements taken in the same 2-rank DDP run.

    .venv/bin/python tests/benchmarks/accuracy.py            # 300 steps, 100 all-reduces
    .venv/bin/python tests/benchmarks/accuracy.py --quick    # 30 steps, 20 all-reduces

In each rank (gloo, 127.0.0.1, the monitor with its defaults and the
auto-started exporter):

* step time: ``rankscope_step_duration_seconds`` (_sum/_count, scraped from
  the exporter) against the trainer's own ``perf_counter`` around each
  ``with monitor.step()`` block, and against the wall clock of the whole loop;
* explicit all-reduce: ``rankscope_collective_duration_seconds{op="all_reduce"}``
  (the increase over the phase) against ``perf_counter`` around each blocking
  ``dist.all_reduce`` (4 MiB, after a barrier);
* DDP buckets (``comm_timing="hook"``): the comm hook's per-bucket durations (summed per step) against
  the reducer's own ``backward_comm_time`` (DDP runtime logging, C++ timers,
  first bucket launch to last completion) -- different definitions, printed
  for orientation, not expected to match.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (REPO, emit_json, kill_noted_ranks, loadavg, machine, mlp, monitored_step,  # noqa: E402
                    note_rank_pid, table)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--allreduces", type=int, default=100)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="30 steps, 20 all-reduces: a smoke run")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.allreduces = min(args.steps, 30), min(args.allreduces, 20)
    return args


def _histogram(url: str, name: str, **labels: str) -> tuple[float, float]:
    from tests.helpers.jobs import scrape, value

    samples = scrape(url)
    total, count = value(samples, name + "_sum", **labels), value(samples, name + "_count", **labels)
    return (total or 0.0), (count or 0.0)


def _wait_count(url: str, name: str, count: float, **labels: str) -> tuple[float, float]:
    """The histogram once the exporter serves at least ``count`` observations (published every 0.5 s)."""
    from tests.helpers.jobs import wait_until

    return wait_until(lambda: (h := _histogram(url, name, **labels))[1] >= count and h, timeout=60,
                      what=f"{name} count >= {count}")


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from rankscope.monitor import Monitor

    note_rank_pid(args.out)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # The hook, to compare per-bucket timing with DDP's own timers (which the
    # default on CPU, comm_timing="reducer", reports as they are).
    monitor = Monitor(run="accuracy-bench", metrics_port=args.port, comm_timing="hook")
    url = f"http://127.0.0.1:{args.port}/metrics"
    me = {"rank": str(rank)}
    torch.manual_seed(0)
    h = args.hidden
    model = monitor.watch(DDP(mlp(h)))
    model._set_ddp_runtime_logging_sample_rate(1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x, y = torch.randn(args.batch, h), torch.randn(args.batch, h)
    perf = time.perf_counter

    step_times, ddp_comm = [], []
    dist.barrier()
    loop0 = perf()
    for _ in range(args.steps):
        t0 = perf()
        monitored_step(monitor, model, opt, x, y)
        step_times.append(perf() - t0)
        ddp_comm.append(model._get_ddp_logging_data().get("backward_comm_time", 0) / 1e9)
    loop_wall = perf() - loop0
    step_sum, step_count = _wait_count(url, "rankscope_step_duration_seconds", args.steps, **me)
    bucket_sum, bucket_count = _histogram(url, "rankscope_collective_duration_seconds", op="all_reduce", **me)

    tensor = torch.ones(2**20)  # 4 MiB of float32
    direct = []
    for _ in range(args.allreduces):
        dist.barrier()
        t0 = perf()
        with monitor.collective("all_reduce", tensor):
            dist.all_reduce(tensor)
        direct.append(perf() - t0)
    ar_sum, ar_count = _wait_count(url, "rankscope_collective_duration_seconds", bucket_count + args.allreduces,
                                   op="all_reduce", **me)
    dist.barrier()
    monitor.close()
    n_ddp = len(ddp_comm) - 1  # the first step's logging data predates DDP's bucket rebuild
    result = {
        "rank": rank, "steps": args.steps, "rankscope_step_count": step_count,
        "rankscope_step_mean_s": step_sum / step_count, "trainer_step_mean_s": sum(step_times) / len(step_times),
        "loop_wall_per_step_s": loop_wall / args.steps,
        "allreduces": args.allreduces, "rankscope_allreduce_count": ar_count - bucket_count,
        "rankscope_allreduce_mean_s": (ar_sum - bucket_sum) / max(ar_count - bucket_count, 1),
        "direct_allreduce_mean_s": sum(direct) / len(direct),
        "rankscope_buckets_per_step": bucket_count / args.steps,
        "rankscope_bucket_time_per_step_s": bucket_sum / args.steps,
        "ddp_backward_comm_per_step_s": sum(ddp_comm[1:]) / max(n_ddp, 1),
    }
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    return 0


def launch(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(REPO))
    from tests.helpers.jobs import free_port

    tmp = Path(tempfile.mkdtemp(prefix="rankscope-accuracy-"))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PROMETHEUS_"))}
    env.update(RANKSCOPE_METRICS_DIR=str(tmp / "metrics"), PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(__file__).resolve()), "--worker", "--out", str(tmp), "--port", str(port),
           "--steps", str(args.steps), "--allreduces", str(args.allreduces), "--hidden", str(args.hidden),
           "--batch", str(args.batch)]
    load_before = loadavg()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=1800)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc.returncode != 0:  # torchrun died or was killed: its ranks may not have
            kill_noted_ranks(tmp)
        _kill_exporter(port)
    if rc != 0:
        print(f"torchrun failed with exit code {rc}", file=sys.stderr)
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        return 1
    ranks = [json.loads((tmp / f"rank{r}.json").read_text()) for r in (0, 1)]
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    for r in ranks:
        ms = lambda v: f"{1000 * v:.3f}"
        rows += [
            [r["rank"], "step time (mean)", ms(r["rankscope_step_mean_s"]), ms(r["trainer_step_mean_s"]),
             "perf_counter around each step", f"{r['rankscope_step_mean_s'] / r['trainer_step_mean_s']:.4f}"],
            [r["rank"], "step time (mean)", ms(r["rankscope_step_mean_s"]), ms(r["loop_wall_per_step_s"]),
             "loop wall clock / steps", f"{r['rankscope_step_mean_s'] / r['loop_wall_per_step_s']:.4f}"],
            [r["rank"], "steps counted", int(r["rankscope_step_count"]), r["steps"], "loop counter",
             f"{r['rankscope_step_count'] / r['steps']:.4f}"],
            [r["rank"], "explicit all_reduce 4 MiB (mean)", ms(r["rankscope_allreduce_mean_s"]),
             ms(r["direct_allreduce_mean_s"]), "perf_counter around dist.all_reduce",
             f"{r['rankscope_allreduce_mean_s'] / r['direct_allreduce_mean_s']:.4f}"],
            [r["rank"], "all_reduce calls counted", int(r["rankscope_allreduce_count"]), r["allreduces"], "loop counter",
             f"{r['rankscope_allreduce_count'] / r['allreduces']:.4f}"],
            [r["rank"], f"DDP bucket time per step ({r['rankscope_buckets_per_step']:.0f} buckets, summed)",
             ms(r["rankscope_bucket_time_per_step_s"]), ms(r["ddp_backward_comm_per_step_s"]),
             "DDP reducer backward_comm_time (different definition)",
             f"{r['rankscope_bucket_time_per_step_s'] / r['ddp_backward_comm_per_step_s']:.4f}"],
        ]
    print(f"rankscope accuracy: 2 ranks (gloo), {args.hidden}x3 MLP, {args.steps} steps, "
          f"{args.allreduces} explicit all-reduces")
    print(table(["rank", "quantity", "rankscope (ms)", "independent (ms)", "independent measure", "ratio"], rows))
    print(f"\nload average {load_before} -> {loadavg()}")
    emit_json({"benchmark": "accuracy", "ranks": ranks, "machine": machine()})
    return 0


def _kill_exporter(port: int) -> None:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp:
            os.kill(int(json.loads(resp.read())["pid"]), signal.SIGKILL)
    except Exception:
        pass


def main(argv=None) -> int:
    args = parse_args(argv)
    return worker(args) if args.worker else launch(args)


if __name__ == "__main__":
    raise SystemExit(main())
