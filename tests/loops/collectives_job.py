"""A job as users write it: steps with one all-reduce and one all-gather each, then teardown.

    torchrun --master-addr 127.0.0.1 --master-port P --nproc-per-node 2 collectives_job.py \
        --steps 40 [--teardown close-first|destroy-first|destroy-never-close] [--step-delay S]

--teardown   close-first:          monitor.close(), then dist.destroy_process_group() (the README's order)
             destroy-first:        dist.destroy_process_group(), then monitor.close() (torchtitan's)
             destroy-never-close:  dist.destroy_process_group() and no close(): the exit hook closes
--step-delay seconds each step sleeps, so that jobs overlap in time

With $LOOP_HOLD set (a directory) every rank waits after its last step, before its
teardown, until $LOOP_HOLD/release exists (so a test can look at a job that is still
running), and says so with $LOOP_HOLD/holding<N>. Writes $LOOP_OUT/rank<N>.json: the
run id the monitor took, the steps run.
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from rankscope import Monitor


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--teardown", default="close-first", choices=("close-first", "destroy-first", "destroy-never-close"))
    p.add_argument("--step-delay", type=float, default=0.0)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    monitor = Monitor(device=torch.device("cpu"))
    x = torch.ones(256)
    gathered = torch.empty(256 * world)
    for _ in range(args.steps):
        with monitor.step(samples=1) as step:
            dist.all_reduce(x)
            dist.all_gather_into_tensor(gathered, x)
            x.div_(world)
            step.observe(loss=float(x[0]))
        time.sleep(args.step_delay)
    out = Path(os.environ["LOOP_OUT"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({"run": monitor.identity.run, "steps": args.steps}))
    hold = os.environ.get("LOOP_HOLD")
    if hold:
        Path(hold, f"holding{rank}").touch()
        while not Path(hold, "release").exists():
            time.sleep(0.05)
    if args.teardown == "close-first":
        monitor.close()
        dist.destroy_process_group()
    elif args.teardown == "destroy-first":
        dist.destroy_process_group()
        monitor.close()
    else:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
