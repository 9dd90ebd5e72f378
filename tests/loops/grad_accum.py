"""Gradient accumulation: one optimizer step, and one monitored step, per MICRO micro-batches.

    python grad_accum.py SHAPE[,SHAPE...] [STEPS] [MICRO] [SLEEP_MS]
    torchrun --standalone --nproc-per-node 2 grad_accum.py no_sync [STEPS] [MICRO] [SLEEP_MS]

SHAPE
  inside   the micro-batches are fetched inside the step (next(it) per micro-batch)
  before   the step's micro-batches are fetched first, then one step runs over them
  no_sync  as inside, under DDP (torchrun), with model.no_sync() for all but the last micro-batch

Each SHAPE is its own training run, one after the other, with its own
Monitor (run "<RANKSCOPE_RUN>-<SHAPE>"), closed before the next one opens.
The loader takes SLEEP_MS per batch (a slow collate). The script measures,
with its own clock, the loop's wall time and the time it spent waiting for
batches, and once the run's monitor is closed writes them to
$LOOP_OUT/<SHAPE>/rank<N>.json.
"""

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torch.utils.data.dataloader import default_collate

from rankscope import Monitor

BATCH = 8


def train(shape: str, steps: int, micro: int, sleep_s: float, distributed: bool) -> None:
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1

    def slow_collate(batch):
        time.sleep(sleep_s)   # decoding, augmentation...
        return default_collate(batch)

    torch.manual_seed(0)
    n = steps * micro * BATCH * world
    data = TensorDataset(torch.randn(n, 16), torch.randint(0, 4, (n,)))
    sampler = DistributedSampler(data, shuffle=False) if distributed else None
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler, collate_fn=slow_collate, drop_last=True)

    monitor = Monitor(device=torch.device("cpu"), run=f"{os.environ.get('RANKSCOPE_RUN', 'accum')}-{shape}")
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    if distributed:
        model = monitor.watch(DDP(model))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    waited = 0.0

    def fetch(it):
        nonlocal waited
        t = time.perf_counter()
        batch = next(it)
        waited += time.perf_counter() - t
        return batch

    def micro_step(step, x, y, sync=True):
        ctx = contextlib.nullcontext() if sync or not distributed else model.no_sync()
        with ctx:
            with step.phase("forward"):
                loss = F.cross_entropy(model(x), y) / micro
            with step.phase("backward"):
                loss.backward()
        return loss.detach()

    per_rank_steps = min(steps, len(loader) // micro)
    start = time.perf_counter()
    it = iter(monitor.data(loader))
    for _ in range(per_rank_steps):
        if shape == "before":
            batches = [fetch(it) for _ in range(micro)]
            with monitor.step(samples=micro * BATCH) as step:
                total = sum(micro_step(step, x, y) for x, y in batches)
                with step.phase("optimizer"):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                step.observe(loss=total)
        else:
            with monitor.step(samples=micro * BATCH) as step:
                total = 0.0
                for i in range(micro):
                    x, y = fetch(it)
                    total = total + micro_step(step, x, y, sync=(shape == "inside" or i == micro - 1))
                with step.phase("optimizer"):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                step.observe(loss=total)
    wall = time.perf_counter() - start

    monitor.close()

    out = Path(os.environ.get("LOOP_OUT", ".")) / shape
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "shape": shape, "steps": per_rank_steps, "micro": micro, "batches": per_rank_steps * micro,
        "sleep_s": sleep_s, "wall_s": wall, "data_wait_s": waited}))
    print(f"rank {rank}: {shape}: {per_rank_steps} steps of {micro} micro-batches in {wall:.3f} s, "
          f"{waited:.3f} s waiting for data", flush=True)


def main() -> int:
    shapes = sys.argv[1].split(",")
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    micro = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    sleep_s = (float(sys.argv[4]) if len(sys.argv) > 4 else 5.0) / 1000
    assert all(shape in ("inside", "before", "no_sync") for shape in shapes), shapes
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    for shape in shapes:
        train(shape, steps, micro, sleep_s, distributed)
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
