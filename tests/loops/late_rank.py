"""A job whose Monitor is made first, as the adapters and the reference trainer make it, one of
whose ranks is late to init_process_group (stuck in its own start-up: reading data, say).

    torchrun --standalone --nproc-per-node 4 late_rank.py --late-rank 1 --late-s 30 [--steps 20]

Rank --late-rank sleeps --late-s seconds before init_process_group; its peers wait for it
in the rendezvous. Then every rank runs --steps steps of one all-reduce each. Run as one node
of two (torchrun --nnodes 2 --node-rank 0 ...) whose other node never starts, its ranks wait
in the rendezvous until --give-up-s, then exit 0 (the test has seen what it came for).
"""

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist

from rankscope import Monitor


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--late-rank", type=int, default=-1)
    p.add_argument("--late-s", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--give-up-s", type=float, default=600.0)
    args = p.parse_args()
    monitor = Monitor(device=torch.device("cpu"))
    if int(os.environ["RANK"]) == args.late_rank:
        time.sleep(args.late_s)
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.give_up_s))
    except Exception:   # the other node never came: nothing to train
        monitor.close()
        return
    t = torch.ones(1024)
    for _ in range(args.steps):
        with monitor.step(samples=1):
            dist.all_reduce(t)
            time.sleep(0.02)
    monitor.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
