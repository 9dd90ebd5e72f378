"""What reading a full flight-recorder ring costs the training thread's collective launches.

    .venv/bin/python tests/benchmarks/ring_read_launch.py                  # gloo (CPU), a 20,000-entry ring
    python tests/benchmarks/ring_read_launch.py --backend nccl             # NCCL on cuda:0 (the GPU check runs it)

torch's recorder copies its whole ring under a mutex when it is read
(``dump_entries``), and every collective launch takes that mutex to record
itself: while rankscope reads a large ring (torchtitan keeps 20,000 entries),
the training thread's launches can wait. One process, a 1-rank group: the ring
is filled with small all-reduces, then the launch time of an ``async_op``
all-reduce (the host time of the call: what the training thread pays) is
measured in blocks of ``--block-s`` seconds, interleaved: without a reader, and
with a thread reading the ring back to back as rankscope does (through torch's worker server,
``FlightRecorderSource.entries_json``; for NCCL inside the device's guard).

Prints the launch time's median, 99th percentile and maximum in each state,
their ratios (reading / idle), and how long one read of the full ring takes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, emit_json, machine, percentile, table  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--ring", type=int, default=20000, help="TORCH_FR_BUFFER_SIZE (torchtitan's 20,000)")
    p.add_argument("--blocks", type=int, default=10, help="interleaved blocks of each state")
    p.add_argument("--block-s", type=float, default=2.0,
                   help="seconds of launches per block (a reading block spans several full reads)")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.ring, args.blocks, args.block_s = 500, 2, 0.2
    os.environ["TORCH_FR_BUFFER_SIZE"] = str(args.ring)   # before torch creates its recorder

    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO))
    from rankscope.collectives.ring_source import FlightRecorderSource
    from rankscope.device.rank_device import RankDevice
    from tests.helpers.jobs import free_port

    nccl = args.backend == "nccl"
    device = torch.device("cuda", 0) if nccl else torch.device("cpu")
    init = dict(device_id=device) if nccl else {}
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            **init)
    t = torch.zeros(16, device=device)
    for _ in range(args.ring):   # a full ring
        dist.all_reduce(t)
    if nccl:
        torch.cuda.synchronize()
    rank_device = RankDevice(lambda what, reason: None)
    rank_device.bind(device)
    recorder = "nccl" if nccl else "cpu"
    source = FlightRecorderSource(Path(tempfile.mkdtemp(prefix="rankscope-ring-")), 0, recorders=(recorder,),
                                  device=rank_device)
    reads: list[float] = []
    reading = threading.Event()
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            if not reading.wait(0.05):
                continue
            t0 = time.perf_counter()
            with rank_device.on_device():
                source.entries_json(recorder)
            reads.append(time.perf_counter() - t0)

    thread = threading.Thread(target=reader, name="rankscope-process-groups", daemon=True)
    thread.start()
    launches: dict[str, list[float]] = {"idle": [], "reading": []}
    for block in range(2 * args.blocks):
        state = ("idle", "reading")[(block + block // 2) % 2]   # ABBA
        if state == "reading":
            reading.set()
            time.sleep(0.01)   # the read under way
        else:
            reading.clear()
            time.sleep(0.05)   # the last read done
        end = time.perf_counter() + args.block_s
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            work = dist.all_reduce(t, async_op=True)
            launches[state].append(time.perf_counter() - t0)
            work.wait()
    stop.set()
    reading.set()
    thread.join(timeout=10)
    source.close()
    dist.destroy_process_group()

    def summary(values: list[float]) -> dict[str, float]:
        return {"median_us": statistics.median(values) * 1e6, "p99_us": percentile(values, 99) * 1e6,
                "p999_us": percentile(values, 99.9) * 1e6, "max_us": max(values) * 1e6,
                "over_1ms": sum(v > 1e-3 for v in values), "n": len(values)}

    idle, busy = summary(launches["idle"]), summary(launches["reading"])
    figures = {"benchmark": "ring_read_launch", "backend": args.backend, "ring": args.ring, "idle": idle, "reading": busy,
               "median_ratio": busy["median_us"] / idle["median_us"], "p99_ratio": busy["p99_us"] / idle["p99_us"],
               "full_ring_read_ms": statistics.median(reads) * 1e3 if reads else None, "reads": len(reads),
               "machine": machine()}
    print(table(("launch of an async all_reduce", "median us", "p99 us", "p99.9 us", "max us", "> 1 ms", "launches"),
                [(state, f"{s['median_us']:.1f}", f"{s['p99_us']:.1f}", f"{s['p999_us']:.0f}", f"{s['max_us']:.0f}",
                  s["over_1ms"], s["n"]) for state, s in (("no read", idle), ("while the ring is read", busy))]))
    print(f"reading / idle: median x{figures['median_ratio']:.2f}, p99 x{figures['p99_ratio']:.2f}; "
          f"one read of the {args.ring}-entry ring: {figures['full_ring_read_ms'] or float('nan'):.1f} ms "
          f"({len(reads)} reads)")
    emit_json(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
