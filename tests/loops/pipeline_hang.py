"""A pipeline of three stages (one rank each) whose world group carries both its sends and
receives and a collective, as a pipeline that syncs tied weights or the loss does:

    torchrun --standalone --nproc-per-node 3 pipeline_hang.py --hang-rank 1 --hang-step 30

Each step: stage 0 sends activations to stage 1, stage 1 receives and sends to stage 2, stage 2
receives; then every rank all-reduces a gradient over the world. The stages do unequal numbers
of sends and receives (stage 1 twice the others'). At --hang-step, --hang-rank stops before the
all-reduce, outside any collective, for good: its peers wait in it.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

from rankscope import Monitor


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--hang-step", type=int, default=-1)
    p.add_argument("--step-delay", type=float, default=0.05)
    args = p.parse_args()
    dist.init_process_group("gloo")
    monitor = Monitor(device=torch.device("cpu"))
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    activations, grad = torch.ones(256), torch.ones(1024)
    for step in range(args.steps):
        with monitor.step(step=step, samples=1):
            if rank > 0:
                dist.recv(activations, rank - 1)
            if rank < last:
                dist.send(activations, rank + 1)
            time.sleep(args.step_delay)
            if rank == args.hang_rank and step == args.hang_step:
                while True:
                    time.sleep(1)
            dist.all_reduce(grad)
    monitor.close()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
