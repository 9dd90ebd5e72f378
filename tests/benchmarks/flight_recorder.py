"""What each way of seeing every collective costs, and how long each holds the GIL.

    .venv/bin/python tests/benchmarks/flight_recorder.py                # a full 2000-entry ring, 20 repeats
    .venv/bin/python tests/benchmarks/flight_recorder.py --ring 20000   # torchtitan's ring, full
    .venv/bin/python tests/benchmarks/flight_recorder.py --quick        # smoke only

One process, a 1-rank gloo group on 127.0.0.1 (the flight recorder records a
1-rank group's collectives as any other's). Measured:

* the cost per collective of torch's flight recorder recording it (a small
  all_reduce with ``TORCH_FR_BUFFER_SIZE=0`` against the default 2000, each in
  a fresh process, interleaved in blocks);
* reading the recorder: the status only (``_dump_fr_trace_json(False, False)``),
  the whole ring as JSON and as a pickle through the Python binding, and the
  whole ring through torch's C++ worker server (what rankscope does);
* rankscope's reader (rankscope.collectives.process_groups) on a full ring of new
  entries;
* for each read, the longest the GIL was unavailable to another Python thread:
  a thread that sleeps 0.1 ms in a loop records its longest gap (its baseline,
  with nothing else running, is printed too: the machine's own scheduling noise);
* ``_register_on_completion_hook`` on gloo (NCCL only: it raises).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, emit_json, machine, table  # noqa: E402


class GapMeter:
    """A thread that wants the GIL every 0.1 ms; its longest wait while a read runs."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop:
            time.sleep(0.0001)
            now = time.perf_counter()
            self.gaps.append(now - last)
            last = now

    def __enter__(self) -> "GapMeter":
        self._thread.start()
        time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self._stop = True
        self._thread.join()

    def longest_during(self, fn, repeats: int) -> tuple[float, float]:
        """(median seconds of fn, longest gap in seconds while fn ran), over ``repeats`` calls."""
        durations, worst = [], 0.0
        for _ in range(repeats):
            self.gaps.clear()
            t0 = time.perf_counter()
            fn()
            durations.append(time.perf_counter() - t0)
            time.sleep(0.002)   # the meter's last gap ends after fn returned
            worst = max(worst, max(self.gaps, default=0.0))
            time.sleep(0.01)
        return statistics.median(durations), worst


def record_cost_worker(n: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['BENCH_PORT']}", rank=0, world_size=1)
    t = torch.zeros(16)
    for _ in range(200):
        dist.all_reduce(t)
    t0 = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(t)
    print(json.dumps({"us_per_collective": (time.perf_counter() - t0) / n * 1e6}))
    dist.destroy_process_group()


def record_cost(blocks: int, n: int, ring: int) -> dict[str, list[float]]:
    sys.path.insert(0, str(REPO))
    from tests.helpers.jobs import free_port

    out: dict[str, list[float]] = {"0": [], str(ring): []}
    for _ in range(blocks):
        for size in out:
            env = {**os.environ, "TORCH_FR_BUFFER_SIZE": size, "BENCH_PORT": str(free_port())}
            proc = subprocess.run([sys.executable, __file__, "--record-worker", str(n)], env=env, capture_output=True,
                                  text=True, timeout=300, check=True)
            out[size].append(json.loads(proc.stdout.strip().splitlines()[-1])["us_per_collective"])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ring", type=int, default=2000,
                   help="TORCH_FR_BUFFER_SIZE: entries the recorder keeps (torch's default 2000, torchtitan's 20000)")
    p.add_argument("--entries", type=int, default=None, help="collectives recorded before reading (default: --ring)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--blocks", type=int, default=6, help="interleaved process blocks for the recording cost")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--record-worker", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.record_worker:
        record_cost_worker(args.record_worker)
        return 0
    if args.quick:
        args.entries, args.repeats, args.blocks = 300, 3, 1
    if args.entries is None:
        args.entries = args.ring
    os.environ["TORCH_FR_BUFFER_SIZE"] = str(args.ring)   # before torch starts its recorder

    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import _dump_fr_trace, _dump_fr_trace_json

    sys.path.insert(0, str(REPO))
    from rankscope.collectives.group_reader import ProcessGroupReader
    from rankscope.collectives.ring_source import FlightRecorderSource
    from tests.helpers.jobs import free_port

    recording = record_cost(args.blocks, 2000 if not args.quick else 300, args.ring)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    t = torch.zeros(16)
    for _ in range(args.entries):
        dist.all_reduce(t)
    try:
        dist.group.WORLD._register_on_completion_hook(lambda work: None)
        hook = "accepted"
    except RuntimeError as e:
        hook = str(e).split("\n")[0]

    tmp = Path(tempfile.mkdtemp(prefix="rankscope-fr-bench-"))
    source = FlightRecorderSource(tmp, 0)

    class Sink:
        def __getattr__(self, name):
            shapes = {"process_group_counters": 3, "process_group_seq": 2}
            return lambda *a, **k: tuple(Child() for _ in range(shapes[name])) if name in shapes else Child()

    class Child:
        def inc(self, *a): pass
        def set(self, *a): pass
        def observe(self, *a): pass

    def reader_poll():
        reader = ProcessGroupReader(Sink(), lambda *a, **k: None, lambda: None, source, 16, 60.0,
                                    entries_every_s=0.0, ring=args.ring)
        c0 = time.thread_time()
        reader.poll()
        reader_poll.cpu.append(time.thread_time() - c0)
        reader_poll.slices.append(reader.longest_slice_s)
        reader_poll.cpu_slices.append(reader.longest_slice_cpu_s)
        reader_poll.entries = reader.entries_read
    reader_poll.slices = []
    reader_poll.cpu_slices = []
    reader_poll.cpu = []
    reader_poll.entries = 0

    reads = {
        "status only (_dump_fr_trace_json(False, False))": lambda: _dump_fr_trace_json(False, False),
        "whole ring, JSON, Python binding": lambda: _dump_fr_trace_json(True, False),
        "whole ring, JSON, binding + json.loads": lambda: json.loads(_dump_fr_trace_json(True, False)),
        "whole ring, pickle, Python binding (no stacks)": lambda: _dump_fr_trace(True, False, False),
        "whole ring, JSON, C++ worker server (fetch only)": source.entries_json,
        "rankscope reader: status + server fetch + decode of new entries": reader_poll,
    }
    # CPU of one full-ring fetch on the server's C++ thread: the process's CPU minus this thread's
    # (measured with no other Python thread running).
    server_cpu = []
    for _ in range(args.repeats):
        p0, t0 = time.process_time(), time.thread_time()
        source.entries_json()
        server_cpu.append((time.process_time() - p0) - (time.thread_time() - t0))
    rows, figures = [], {"ring": args.ring, "entries": args.entries, "reads": {}}
    with GapMeter() as meter:
        time.sleep(0.3)
        meter.gaps.clear()
        time.sleep(0.5)
        baseline = max(meter.gaps)
        for name, fn in reads.items():
            median_s, gap_s = meter.longest_during(fn, args.repeats)
            rows.append([name, f"{1000 * median_s:.3f}", f"{1000 * gap_s:.2f}"])
            figures["reads"][name] = {"median_ms": 1000 * median_s, "longest_gil_gap_ms": 1000 * gap_s}
    source.close()
    dist.destroy_process_group()
    rec0, rec1 = statistics.median(recording["0"]), statistics.median(recording[str(args.ring)])
    # The reader fetches the ring once half of it is new: per collective, its CPU (the server's
    # fetch on its C++ thread and the reader's own decode) is the cost of one read over ring/2.
    per_read_ms = 1000 * (statistics.median(server_cpu) + statistics.median(reader_poll.cpu))
    per_1000_ms = per_read_ms / max(args.ring / 2, 1) * 1000
    print(f"flight recorder reads: ring {args.ring}, {args.entries} entries in it, {args.repeats} repeats; "
          f"gap meter baseline (nothing else running) {1000 * baseline:.2f} ms")
    print(table(["read", "median ms", "longest GIL gap of another thread, ms"], rows))
    print()
    print(table(["recording cost", "value"], [
        [f"small gloo all_reduce, TORCH_FR_BUFFER_SIZE=0 / {args.ring} (us, median of blocks)",
         f"{rec0:.1f} / {rec1:.1f}"],
        ["recording, per collective (us)", f"{rec1 - rec0:+.1f}"],
        ["rankscope reader: longest decode slice between GIL yields, wall / own CPU (ms)",
         f"{1000 * max(reader_poll.slices):.3f} / {1000 * max(reader_poll.cpu_slices):.3f} "
         f"({reader_poll.entries} entries)"],
        ["C++ worker server: CPU per full-ring fetch on its own thread (ms, median)",
         f"{1000 * statistics.median(server_cpu):.1f}"],
        ["rankscope reader: CPU per read, its own thread (ms, median)",
         f"{1000 * statistics.median(reader_poll.cpu):.1f}"],
        ["CPU per 1000 collectives, reading once half the ring is new (ms; x collectives/s / 1000 = share of a core)",
         f"{per_1000_ms:.1f}"],
        ["_register_on_completion_hook on gloo", hook],
    ]))
    figures.update(gap_baseline_ms=1000 * baseline, record_us={"off": rec0, "on": rec1},
                   reader_longest_slice_ms=1000 * max(reader_poll.slices),
                   reader_longest_slice_cpu_ms=1000 * max(reader_poll.cpu_slices), completion_hook_gloo=hook,
                   server_cpu_ms_per_fetch=1000 * statistics.median(server_cpu),
                   reader_cpu_ms_per_read=1000 * statistics.median(reader_poll.cpu),
                   cpu_ms_per_1000_collectives=per_1000_ms,
                   machine=machine())
    emit_json({"benchmark": "flight_recorder", **figures})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
