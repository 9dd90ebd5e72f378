"""A plain training script: DDP under torchrun, a single process without it.

    python train.py --steps 30
    torchrun --standalone --nproc-per-node 2 train.py --steps 30 [--find-unused-parameters] [--monitor-before-init]

--find-unused-parameters  the model has an auxiliary head the loop never uses,
                          so DDP must be told (find_unused_parameters=True)
--monitor-before-init     create the Monitor before dist.init_process_group

Writes $LOOP_OUT/rank<N>.json (steps run, world size, last loss reported).
"""

import argparse
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

from rankscope import Monitor


class Net(nn.Module):
    def __init__(self, aux_head: bool = False):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.head = nn.Linear(32, 4)
        # for an auxiliary loss that is off in this run: its parameters get no gradient
        self.aux_head = nn.Linear(32, 2) if aux_head else None

    def forward(self, x, aux=False):
        h = self.body(x)
        return (self.head(h), self.aux_head(h)) if aux else self.head(h)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--find-unused-parameters", action="store_true")
    p.add_argument("--monitor-before-init", action="store_true")
    args = p.parse_args()

    distributed = "WORLD_SIZE" in os.environ
    monitor = None
    if args.monitor_before_init:
        monitor = Monitor(device=torch.device("cpu"))
    if distributed:
        dist.init_process_group("gloo")
    if monitor is None:
        monitor = Monitor(device=torch.device("cpu"))
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1

    torch.manual_seed(0)
    n = args.steps * args.batch_size * world
    data = TensorDataset(torch.randn(n, 16), torch.randint(0, 4, (n,)))
    sampler = DistributedSampler(data) if distributed else None
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, shuffle=sampler is None)
    model = Net(aux_head=args.find_unused_parameters)
    if distributed:
        model = monitor.watch(DDP(model, find_unused_parameters=args.find_unused_parameters))
    elif args.find_unused_parameters:
        print("--find-unused-parameters needs torchrun (DDP)", file=sys.stderr)
        return 2
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    steps, last_loss = 0, None
    start = time.perf_counter()
    for x, y in monitor.data(loader):
        with monitor.step(samples=len(x)) as step:
            with step.phase("forward"):
                loss = F.cross_entropy(model(x), y)
            with step.phase("backward"):
                loss.backward()
            with step.phase("optimizer"):
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
            step.observe(loss=loss.detach(), grad_norm=norm, lr=opt.param_groups[0]["lr"])
        steps += 1
        last_loss = loss.item()
    wall = time.perf_counter() - start

    out = Path(os.environ.get("LOOP_OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({"steps": steps, "world_size": world, "loss": last_loss,
                                                      "wall_s": wall, "pid": os.getpid()}))
    print(f"rank {rank}/{world}: {steps} steps in {wall:.2f} s, loss {last_loss:.4f}", flush=True)
    monitor.close()
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
