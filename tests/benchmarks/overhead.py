"""Overhead of rankscope on a real 2-rank DDP job (gloo, 127.0.0.1).

    .venv/bin/python tests/benchmarks/overhead.py            # 4000 rounds (~9 min idle)
    .venv/bin/python tests/benchmarks/overhead.py --quick    # 50 rounds, smoke only

Block-wise A/B has about +-5% noise per pair on a shared 2-core machine
(docs/performance.md, "Library costs"), far above a 1% effect, so the variants are
interleaved step by step inside the same two rank processes. Each rank holds
three DDP wrappers of identical copies of one model (a DDP comm hook belongs to
its wrapper, and two wrappers of the *same* parameters would both fire):

* A ``bare``:        plain DDP, no rankscope call at all
* B ``full``:        ``monitor.watch(DDP)`` with the default ``comm_timing``
                     (``auto``: DDP's own timers on CPU, no comm hook) and the
                     whole step API (data, step, phases, observe)
* C ``hook``:        the same with rankscope's bucket-timing comm hook, as
                     ``comm_timing="hook"`` registers it

Every round runs one step of each, in an order that cycles through all six
permutations (a counterbalanced generalisation of ABBA: every variant is
first, middle and last equally often), with an untimed barrier before each
step. The monitor runs with its defaults: metrics on, the node exporter
auto-started, tracing on (a real OTLP/gRPC receiver in this process, every
100th step sampled); a thread here scrapes /metrics every second.

``--parallelism fsdp2`` measures the same way on FSDP2 (``fully_shard`` on
each linear layer and the root): two sharded copies of the model, A ``bare``
and B ``full`` (``monitor.watch`` of the sharded model and the step API); the
collectives are seen through torch's flight recorder, read by the monitor's
``rankscope-process-groups`` thread, whose CPU is reported with the other
background threads.

What the interleaving cannot separate: the monitor's background threads and
the exporter run during bare steps too. Their CPU is measured directly and
reported as a share of the node's CPU next to the paired figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (REPO, bare_step, emit_json, kill_noted_ranks, loadavg, machine, mean_ci, mlp,  # noqa: E402
                    monitored_step, note_rank_pid, proc_cpu_seconds, table, threads_cpu_seconds)

VARIANTS_BY_PARALLELISM = {"ddp": ("bare", "full", "hook"), "fsdp2": ("bare", "full")}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # 4000: the 95% interval is about +-0.5% of a step here (+-1% at 1000 pairs)
    p.add_argument("--rounds", type=int, default=4000, help="rounds of one step per variant (pairs per comparison)")
    p.add_argument("--warmup", type=int, default=12, help="rounds discarded at the start")
    p.add_argument("--hidden", type=int, default=1024, help="width of the 3-layer MLP (1024: ~3.1 M parameters)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--parallelism", choices=sorted(VARIANTS_BY_PARALLELISM), default="ddp",
                   help="ddp (default: bare, full, hook) or fsdp2 (bare, full)")
    p.add_argument("--quick", action="store_true", help="50 rounds: a smoke run, not a measurement")
    p.add_argument("--no-tracing", action="store_true", help="do not start the OTLP receiver")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.warmup = min(args.rounds, 50), 3
    return args


# -- rank side ---------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> int:
    import copy

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from rankscope.collectives.comm_timing import HookTiming
    from rankscope.monitor import Monitor

    note_rank_pid(args.out)
    torch.set_num_threads(1)  # 2 ranks share 2 cores
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    monitor = Monitor(run="overhead-bench", metrics_port=args.port)
    torch.manual_seed(0)
    h = args.hidden
    base = mlp(h)
    variants = VARIANTS_BY_PARALLELISM[args.parallelism]
    orders = list(itertools.permutations(range(len(variants))))
    if args.parallelism == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        def sharded(model):
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer)
            return fully_shard(model)

        models = [sharded(copy.deepcopy(base)), monitor.watch(sharded(copy.deepcopy(base)))]
    else:
        models = [DDP(copy.deepcopy(base)), monitor.watch(DDP(copy.deepcopy(base))), DDP(copy.deepcopy(base))]
        # One monitor per process: variant C gets the hook that watch() registers with comm_timing="hook".
        HookTiming(monitor.parts.tracker, lambda: None).attach(models[2])
    opts = [torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9) for m in models]
    batch = (torch.randn(args.batch, h), torch.randn(args.batch, h))
    plain_batches = itertools.repeat(batch)
    monitored_batches = [None] + [monitor.data(itertools.repeat(batch)) for _ in models[1:]]
    lr = opts[0].param_groups[0]["lr"]

    def plain() -> None:
        bare_step(models[0], opts[0], *next(plain_batches))

    def monitored(i: int) -> None:
        monitored_step(monitor, models[i], opts[i], *next(monitored_batches[i]), lr=lr)

    steps = [plain] + [lambda i=i: monitored(i) for i in range(1, len(models))]
    times: list[list[float]] = [[] for _ in models]
    perf = time.perf_counter
    background = [t for t in threading.enumerate() if t is not threading.main_thread()]
    cpu0 = threads_cpu_seconds(background)
    wall0 = perf()
    for r in range(args.warmup + args.rounds):
        for i in orders[r % len(orders)]:
            dist.barrier()
            t0 = perf()
            steps[i]()
            t1 = perf()
            if r >= args.warmup:
                times[i].append(t1 - t0)
    wall = perf() - wall0
    background = [t for t in threading.enumerate() if t is not threading.main_thread()]
    bg_cpu = threads_cpu_seconds(background) - cpu0
    dist.barrier()
    replica_check = _replica_check_cost(monitor, models[1], opts[1], batch)
    reader = monitor.parts.process_groups
    monitor.close()
    gil = {"longest_slice_ms": 1000 * reader.longest_slice_s, "longest_slice_cpu_ms": 1000 * reader.longest_slice_cpu_s,
           "entries_read": reader.entries_read} if reader else {}
    result = {"rank": rank, "times": dict(zip(variants, times)), "process_group_reader": gil, "wall_s": wall, "background_cpu_s": bg_cpu,
              "background_threads": sorted({t.name for t in background}), "traced": monitor.tracing.enabled,
              "replica_check": replica_check}
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    return 0


def _replica_check_cost(monitor, model, opt, batch, checks: int = 200) -> dict:
    """The replica check's own work, timed alone on the training thread: ``checks`` checks of the
    watched model (its weights, and its gradients from one backward), each taken and published.
    Inside the paired figures it runs every K-th step of ``full``; this is its cost per check."""
    import time

    import torch

    check = monitor.parts.watched.replica_check
    if check is None:
        return {}
    torch.nn.functional.mse_loss(model(batch[0]), batch[1]).backward()
    t0 = time.perf_counter()
    for i in range(1, checks + 1):
        check.before_optimizer_step(i * check.every)
        check.step_ended(i * check.every)
        check.publish()
    per_check = (time.perf_counter() - t0) / checks
    opt.zero_grad(set_to_none=True)
    tensors = sum(len(s.parameters) for s in check._sets)
    return {"per_check_s": per_check, "every": check.every, "tensors": tensors,
            "bytes": sum(p.numel() * p.element_size() for s in check._sets for p in s.parameters)}


# -- launcher ------------------------------------------------------------------------------
class Scraper(threading.Thread):
    """Hits /metrics every second, as a 1 s Prometheus scrape interval would."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.health = f"http://127.0.0.1:{port}/healthz"
        self.stop_event = threading.Event()
        self.ok = self.failed = 0
        self.exporter_pid: int | None = None
        self.exporter_cpu0 = 0.0
        self.durations: list[float] = []

    def run(self) -> None:
        while not self.stop_event.wait(1.0):
            try:
                if self.exporter_pid is None:
                    with urllib.request.urlopen(self.health, timeout=2) as resp:
                        self.exporter_pid = int(json.loads(resp.read())["pid"])
                        self.exporter_cpu0 = proc_cpu_seconds(self.exporter_pid)
                t0 = time.perf_counter()
                with urllib.request.urlopen(self.url, timeout=10) as resp:
                    resp.read()
                self.durations.append(time.perf_counter() - t0)
                self.ok += 1
            except Exception:
                if self.ok:  # before the first success the exporter is still starting
                    self.failed += 1


def launch(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(REPO))
    from tests.helpers.jobs import free_port

    receiver = None
    if not args.no_tracing:
        try:
            from tests.helpers.otlp_receiver import OtlpReceiver

            receiver = OtlpReceiver().start()
        except Exception as e:  # the helper is optional: say so and measure without tracing
            print(f"note: no OTLP receiver ({e!r}); tracing stays off", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="rankscope-overhead-"))
    port = free_port()
    env = {**os.environ, "RANKSCOPE_METRICS_DIR": str(tmp / "metrics"), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), "GLOO_SOCKET_IFNAME": "lo"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    if receiver is not None:
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="grpc")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(__file__).resolve()), "--worker", "--out", str(tmp), "--port", str(port),
           "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--hidden", str(args.hidden),
           "--batch", str(args.batch), "--parallelism", args.parallelism]
    load_before = loadavg()
    scraper = Scraper(port)
    scraper.start()
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=3600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc.returncode != 0:  # torchrun died or was killed: its ranks may not have
            kill_noted_ranks(tmp)
        scraper.stop_event.set()
        scraper.join(timeout=15)
        elapsed = time.perf_counter() - started
        exporter_cpu = float("nan")
        if scraper.exporter_pid:
            try:
                exporter_cpu = proc_cpu_seconds(scraper.exporter_pid) - scraper.exporter_cpu0
                os.kill(scraper.exporter_pid, signal.SIGKILL)
            except (ProcessLookupError, FileNotFoundError):
                pass
        spans = len(receiver.spans()) if receiver is not None else 0
        if receiver is not None:
            receiver.stop()
    if rc != 0:
        print(f"torchrun failed with exit code {rc}", file=sys.stderr)
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        return 1
    ranks = [json.loads((tmp / f"rank{r}.json").read_text()) for r in (0, 1)]
    _report(args, ranks, scraper, exporter_cpu, elapsed, spans, load_before)
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _compare(times: dict, a: str, b: str) -> dict:
    """Paired differences b - a (same round), as a fraction of a's mean step."""
    ta, tb = times[a], times[b]
    diffs = [y - x for x, y in zip(ta, tb)]
    mean, lo, hi = mean_ci(diffs)
    base = sum(ta) / len(ta)
    med_a, med_b = sorted(ta)[len(ta) // 2], sorted(tb)[len(tb) // 2]
    return {"pairs": len(diffs), "bare_mean_ms": 1000 * base, "diff_ms": 1000 * mean, "ci_ms": [1000 * lo, 1000 * hi],
            "frac": mean / base, "ci_frac": [lo / base, hi / base], "median_ratio": med_b / med_a - 1}


def _report(args, ranks, scraper, exporter_cpu, elapsed, spans, load_before) -> None:
    comparisons = {"full_vs_bare": ("bare", "full"), "hook_vs_bare": ("bare", "hook"),
                   "hook_vs_full": ("full", "hook")}
    if args.parallelism == "fsdp2":
        comparisons = {"full_vs_bare": ("bare", "full")}
    rows, figures = [], {"rounds": args.rounds, "parallelism": args.parallelism, "ranks": {}}
    for r in ranks:
        per_rank = {}
        for label, (a, b) in comparisons.items():
            c = _compare(r["times"], a, b)
            per_rank[label.split(" ")[0]] = c
            rows.append([r["rank"], label, c["pairs"], f"{c['bare_mean_ms']:.2f}", f"{c['diff_ms']:+.3f}",
                         f"[{c['ci_ms'][0]:+.3f}, {c['ci_ms'][1]:+.3f}]",
                         f"{100 * c['frac']:+.2f}% [{100 * c['ci_frac'][0]:+.2f}, {100 * c['ci_frac'][1]:+.2f}]",
                         f"{100 * c['median_ratio']:+.2f}%"])
        per_rank["background_cpu_share_of_core"] = r["background_cpu_s"] / r["wall_s"]
        per_rank["background_threads"] = r["background_threads"]
        per_rank["process_group_reader"] = r["process_group_reader"]
        figures["ranks"][str(r["rank"])] = per_rank
    print(f"rankscope overhead ({args.parallelism}): 2 ranks (gloo, 127.0.0.1), {args.hidden}x3 MLP, batch {args.batch}, "
          f"{args.rounds} rounds after {args.warmup} warm-up, tracing {'on' if ranks[0]['traced'] else 'off'}")
    print(table(["rank", "comparison (B - A)", "pairs", "A mean ms", "mean diff ms", "95% CI ms",
                 "diff / A step [95% CI]", "median ratio - 1"], rows))
    wall = max(r["wall_s"] for r in ranks)
    bg = sum(r["background_cpu_s"] for r in ranks)
    node_share = (bg + (0.0 if math.isnan(exporter_cpu) else exporter_cpu)) / (2 * wall)
    print()
    print(table(["background (not in the paired figures)", "value"], [
        ["monitor threads CPU, rank 0 / rank 1 (s)",
         f"{ranks[0]['background_cpu_s']:.2f} / {ranks[1]['background_cpu_s']:.2f} over {wall:.1f} s"],
        ["exporter CPU (s) over the job", f"{exporter_cpu:.2f}"],
        ["scrapes ok / failed after the first (1 s interval)", f"{scraper.ok} / {scraper.failed}"],
        ["scrape latency median (ms)", f"{1000 * sorted(scraper.durations)[len(scraper.durations) // 2]:.1f}"
         if scraper.durations else "n/a"],
        ["background CPU as share of the node's 2 cores", f"{100 * node_share:.2f}%"],
        ["spans received", spans],
        ["flight-recorder entries read / reader's longest GIL slice, wall / own CPU (ms), rank 0",
         f"{ranks[0]['process_group_reader'].get('entries_read', 0)} / "
         f"{ranks[0]['process_group_reader'].get('longest_slice_ms', float('nan')):.3f} / "
         f"{ranks[0]['process_group_reader'].get('longest_slice_cpu_ms', float('nan')):.3f}"],
        ["load average before / after", f"{load_before} / {loadavg()}"],
    ]))
    check = ranks[0].get("replica_check") or {}
    if check:   # the replica check (rankscope.replicas), inside full's steps every K-th step
        step = figures["ranks"]["0"]["full_vs_bare"]["bare_mean_ms"] / 1000
        share = check["per_check_s"] / check["every"] / step
        print(f"\nreplica check: {1e6 * check['per_check_s']:.0f} us per check (weights and gradients of "
              f"{check['tensors']} tensors, {check['bytes'] / 2**20:.1f} MiB, taken and published), every "
              f"{check['every']} steps: {100 * share:.4f}% of a {1000 * step:.1f} ms step (target <= 0.1%: "
              f"{'met' if share <= 0.001 else 'MISSED'})")
        figures.update(replica_check_per_check_s=check["per_check_s"], replica_check_every=check["every"],
                       replica_check_share_of_step=share)
    full0, full1 = figures["ranks"]["0"]["full_vs_bare"], figures["ranks"]["1"]["full_vs_bare"]
    worst_hi = max(full0["ci_frac"][1], full1["ci_frac"][1])
    print(f"\nfull vs bare, upper 95% bound (worst rank): {100 * worst_hi:+.2f}% (target <= 1%: "
          f"{'met' if worst_hi <= 0.01 else 'MISSED'}); plus background CPU {100 * node_share:.2f}% of the node")
    figures.update(worst_upper_ci_frac=worst_hi, target_met=worst_hi <= 0.01, exporter_cpu_s=exporter_cpu,
                   background_node_cpu_share=node_share, scrapes_ok=scraper.ok, scrapes_failed=scraper.failed,
                   spans_received=spans, wall_s=wall, machine=machine())
    emit_json({"benchmark": "overhead", **figures})


def main(argv=None) -> int:
    args = parse_args(argv)
    return worker(args) if args.worker else launch(args)


if __name__ == "__main__":
    raise SystemExit(main())
