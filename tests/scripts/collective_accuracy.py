"""Run under torchrun (gloo, 2 ranks): times explicit collectives through
Monitor.collective and, around the same calls, with a direct wall clock.
Writes one JSON file per rank to $RESULTS_DIR: per-call (recorded, direct) pairs and the
op-labelled totals the monitor published."""

import json
import os
import time

import torch
import torch.distributed as dist

from rankscope.monitor import Monitor

CALLS = int(os.environ.get("CALLS", "25"))


def main() -> None:
    monitor = Monitor(exporter="off", backend="gloo")
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    tensor = torch.ones(4 * 1024 * 1024)            # 16 MiB of float32
    pairs = []
    for _ in range(3):                               # warm-up
        dist.all_reduce(tensor)
    monitor.parts.tracker.drain()
    for _ in range(CALLS):
        dist.barrier()
        t0 = time.perf_counter()
        with monitor.collective("all_reduce", tensor):
            dist.all_reduce(tensor)
        direct = time.perf_counter() - t0
        (record,) = monitor.parts.tracker.drain()
        pairs.append((record.duration, direct))
    # Every explicit op goes through the same wrapper, labelled by op.
    small = torch.ones(1024)
    gathered = torch.empty(1024 * world)
    with monitor.collective("all_gather", gathered):
        dist.all_gather_into_tensor(gathered, small)
    out = torch.empty(1024)
    with monitor.collective("reduce_scatter", gathered):
        dist.reduce_scatter_tensor(out, gathered)
    with monitor.collective("broadcast", small):
        dist.broadcast(small, src=0)
    with monitor.collective("barrier"):
        dist.barrier()
    monitor.close()   # publishes what the publisher thread has not yet
    ops = sorted((s.labels["op"], s.value) for metric in monitor.parts.metrics.registry.collect()
                 if metric.name == "rankscope_collective_bytes" for s in metric.samples
                 if s.name.endswith("_total") and s.labels["op"] != "all_reduce")
    # One file per rank: two ranks printing to one pipe can interleave their lines.
    out = os.path.join(os.environ["RESULTS_DIR"], f"rank-{dist.get_rank()}.json")
    with open(out, "w") as f:
        json.dump({"rank": dist.get_rank(), "pairs": pairs, "ops": ops}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
