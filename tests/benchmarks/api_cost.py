"""Fixed per-step cost of the Monitor API, in one process, with a step that does nothing.

    .venv/bin/python tests/benchmarks/api_cost.py           # 30,000 steps per configuration
    .venv/bin/python tests/benchmarks/api_cost.py --quick   # 3,000 steps, smoke only

Every step goes through the whole API a training loop uses: ``monitor.data``,
``monitor.step``, three ``phase`` blocks and ``observe(loss, lr)``. Each
configuration runs in its own fresh process (a process holds one Monitor):

* ``tracing off``: no OTLP endpoint, tracing costs one boolean test;
* ``tracing on``: a real OTLP/gRPC receiver (tests/helpers/otlp_receiver.py)
  in the parent, ``RANKSCOPE_TRACE_EVERY=10`` so one step in ten is sampled;
  sampled and unsampled steps are reported apart.

The figure is the median time of a step through the API minus the median of
the same loop without it (the timing harness: two ``perf_counter`` calls and
a generator step). The background publisher and span threads run as they do
in training, and the cyclic GC is on. Then cProfile shows where the training
thread's time goes.

A trivial step runs the API with hot caches. Right after real tensor work the
same Python runs several times slower (its code and data were evicted), so a
third configuration, ``real step``, measures the API around a 3x512 MLP step
(one thread, no DDP): bare and instrumented steps of the *same* model alternate
in ABBA order, and the mean paired difference is the API's cost there.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (REPO, bare_step, emit_json, loadavg, machine, mean_ci, mlp, monitored_step,  # noqa: E402
                    percentile, table)

TARGET_UNSAMPLED_US = 25.0
TARGET_SAMPLED_US = 150.0
TRACE_EVERY = 10


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30_000)
    p.add_argument("--profile-steps", type=int, default=5_000)
    p.add_argument("--quick", action="store_true", help="3,000 steps: a smoke run, not a measurement")
    p.add_argument("--real-pairs", type=int, default=4_000, help="ABBA pairs of the real-step configuration")
    p.add_argument("--child", choices=["off", "on", "real"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.profile_steps, args.real_pairs = min(args.steps, 3_000), 1_000, 200
    return args


# -- child: one configuration ------------------------------------------------------------
def child(args: argparse.Namespace) -> int:
    from rankscope.monitor import Monitor

    if args.child == "real":
        return real_child(args)

    monitor = Monitor(run=f"api-cost-{args.child}", exporter="off")
    perf = time.perf_counter

    def harness(n: int) -> list[float]:
        """The loop below without the API: what timing itself costs."""
        plain = itertools.repeat(1)
        out = []
        for _ in range(n):
            t0 = perf()
            next(plain)
            out.append(perf() - t0)
        return out

    batches = monitor.data(itertools.repeat(1))

    def api_steps(n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = perf()
            next(batches)
            with monitor.step(samples=1) as s:
                with s.phase("forward"):
                    pass
                with s.phase("backward"):
                    pass
                with s.phase("optimizer"):
                    pass
                s.observe(loss=0.5, lr=0.1)
            out.append(perf() - t0)
        return out

    warmup = 200
    api_steps(warmup)
    floor = harness(args.steps)
    first = monitor.parts.steps.step.number + 1
    times = api_steps(args.steps)
    sampled = [t for i, t in enumerate(times, start=first) if monitor.tracing.enabled and i % TRACE_EVERY == 0]
    unsampled = [t for i, t in enumerate(times, start=first) if not (monitor.tracing.enabled and i % TRACE_EVERY == 0)]

    profiler = cProfile.Profile()
    profiler.enable()
    api_steps(args.profile_steps)
    profiler.disable()
    buf = io.StringIO()
    stats = pstats.Stats(profiler, stream=buf).sort_stats("tottime")
    stats.print_stats(14)
    total = sum(v[2] for v in stats.stats.values())  # tottime of every function
    monitor.close()
    result = {"tracing": monitor.tracing.enabled, "floor_us": _median_us(floor),
              "unsampled": _summary(unsampled), "sampled": _summary(sampled) if sampled else None,
              "profile": _trim_profile(buf.getvalue()), "profile_us_per_step": 1e6 * total / args.profile_steps}
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def real_child(args: argparse.Namespace) -> int:
    """The API around a real compute step, ABBA against the same step bare."""
    import torch

    from rankscope.monitor import Monitor

    torch.set_num_threads(1)
    monitor = Monitor(run="api-cost-real", exporter="off")
    h = 512
    model = mlp(h)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x, y = torch.randn(64, h), torch.randn(64, h)
    batches = monitor.data(itertools.repeat((x, y)))
    plain = itertools.repeat((x, y))

    def bare() -> None:
        bare_step(model, opt, *next(plain))

    def instrumented() -> None:
        monitored_step(monitor, model, opt, *next(batches), lr=1e-3)

    perf = time.perf_counter
    times: tuple[list[float], list[float]] = ([], [])
    for r in range(50 + args.real_pairs):
        for i in ((0, 1) if r % 2 else (1, 0)):
            t0 = perf()
            (bare, instrumented)[i]()
            if r >= 50:
                times[i].append(perf() - t0)
    monitor.close()
    diffs = [b - a for a, b in zip(*times)]
    mean, lo, hi = mean_ci(diffs)
    base = statistics.fmean(times[0])
    result = {"pairs": len(diffs), "hidden": h, "bare_mean_ms": 1e3 * base, "diff_us": 1e6 * mean,
              "tracing": monitor.tracing.enabled, "gil_holds": gil_holds(monitor),
              "ci_us": [1e6 * lo, 1e6 * hi], "frac": mean / base,
              "median_diff_us": 1e6 * (statistics.median(times[1]) - statistics.median(times[0]))}
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def gil_holds(monitor) -> dict[str, dict[str, float]]:
    """The longest stretch each background thread ran between two GIL releases (rankscope.holds)."""
    holds = {"publisher (publish)": monitor.parts.publisher.hold, "publisher (absorb slice)": monitor.parts.accounting.hold}
    if monitor.tracing.enabled:
        holds["span sender (pickles a record)"] = monitor.tracing.hold
    result = {name: hold.as_dict() for name, hold in holds.items()}
    if monitor.tracing.enabled:   # spans are built and exported in the rank's span process (rankscope.tracing.span_process)
        result.update({f"span process: {name} (its own GIL)": hold
                       for name, hold in monitor.tracing.child_holds().items()})
    return result


def _median_us(values: list[float]) -> float:
    return 1e6 * percentile(values, 50)


def _hold(h: dict | None) -> str:
    return "-" if h is None else f"{h['longest_wall_ms']:.3f} / {h['longest_cpu_ms']:.3f}"


def _summary(values: list[float]) -> dict:
    return {"n": len(values), "p50_us": 1e6 * percentile(values, 50), "p90_us": 1e6 * percentile(values, 90),
            "p99_us": 1e6 * percentile(values, 99)}


def _trim_profile(text: str) -> str:
    lines = text.strip().splitlines()
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    return "\n".join(line.replace(str(REPO) + "/", "") for line in lines[start:])


# -- parent ---------------------------------------------------------------------------------
def run_child(args: argparse.Namespace, mode: str, endpoint: str | None) -> dict:
    tmp = tempfile.mkdtemp(prefix="rankscope-api-cost-")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "RANKSCOPE_", "PROMETHEUS_"))}
    env.update(RANKSCOPE_METRICS_DIR=tmp, PYTHONPATH=str(REPO))
    if endpoint:
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
                   RANKSCOPE_TRACE_EVERY=str(TRACE_EVERY))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--steps", str(args.steps),
           "--profile-steps", str(args.profile_steps), "--real-pairs", str(args.real_pairs)]
    try:
        out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    finally:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"child {mode} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args)
    sys.path.insert(0, str(REPO))
    from tests.helpers.otlp_receiver import OtlpReceiver

    load_before = loadavg()
    off = run_child(args, "off", None)
    with OtlpReceiver() as receiver:
        on = run_child(args, "on", receiver.endpoint)
        spans = len(receiver.spans())
        real_traced = run_child(args, "real", receiver.endpoint)
    real = run_child(args, "real", None)
    rows, figures = [], {}
    for label, res, key, target in (("tracing off, every step", off, "unsampled", TARGET_UNSAMPLED_US),
                                    ("tracing on, unsampled step", on, "unsampled", TARGET_UNSAMPLED_US),
                                    ("tracing on, sampled step", on, "sampled", TARGET_SAMPLED_US)):
        s = res[key]
        cost = s["p50_us"] - res["floor_us"]
        figures[label.replace(", ", "_").replace(" ", "_")] = {**s, "cost_us": cost, "target_us": target,
                                                                "met": cost <= target}
        rows.append([label, s["n"], f"{res['floor_us']:.2f}", f"{s['p50_us']:.1f}", f"{s['p90_us']:.1f}",
                     f"{s['p99_us']:.1f}", f"{cost:.1f}", f"<= {target:.0f}", "met" if cost <= target else "MISSED"])
    print(f"rankscope API fixed cost per step ({args.steps} steps per configuration, trivial step, GC on)")
    print(table(["configuration", "steps", "harness us", "p50 us", "p90 us", "p99 us", "API cost us (p50 - harness)",
                 "target", ""], rows))
    print(f"\nThe same API around a real step (3x{real['hidden']} MLP, 1 thread, bare {real['bare_mean_ms']:.2f} ms), "
          f"{real['pairs']} ABBA pairs:")
    print(table(["configuration", "pairs", "bare step ms", "mean diff us [95% CI]", "diff / bare step",
                 "median diff us", "target"],
                [[label, r["pairs"], f"{r['bare_mean_ms']:.2f}",
                  f"{r['diff_us']:+.1f} [{r['ci_us'][0]:+.1f}, {r['ci_us'][1]:+.1f}]",
                  f"{100 * r['frac']:+.2f}%", f"{r['median_diff_us']:+.1f}",
                  f"<= {TARGET_UNSAMPLED_US:.0f}: " + ("met" if r["diff_us"] <= TARGET_UNSAMPLED_US else "MISSED")]
                 for label, r in (("real step, tracing off", real),
                                  (f"real step, tracing on (1 step in {TRACE_EVERY})", real_traced))]))
    print("\nLongest GIL hold of each background thread (wall ms / own CPU ms; target <= 1 ms), real step:")
    print(table(["thread", "tracing off", f"tracing on (1 step in {TRACE_EVERY})"],
                [[name, _hold(real["gil_holds"].get(name)), _hold(real_traced["gil_holds"].get(name))]
                 for name in real_traced["gil_holds"]]))
    figures["real_step"] = real
    figures["real_step_traced"] = real_traced
    print(f"\nspans received by the OTLP receiver: {spans}; load average {load_before} -> {loadavg()}")
    for label, res in (("tracing off", off), ("tracing on (1 step in 10 sampled)", on)):
        print(f"\ncProfile, training thread, {label}: {res['profile_us_per_step']:.1f} us/step under the profiler "
              f"(inflated by it), top entries by own time:\n{res['profile']}")
    figures.update(spans_received=spans, trace_every=TRACE_EVERY, steps=args.steps, machine=machine())
    emit_json({"benchmark": "api_cost", **figures})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
