"""A user's DDP loop (2 ranks, gloo) whose fault rank stops making progress in one of the ways
real jobs do, for the evidence a page must carry (tests/drills/test_evidence.py).

    torchrun --nproc-per-node 2 evidence_job.py FAULT [--at STEP] [--steps N]

FAULT (on rank 1, at step --at; rank 0 trains on, so it waits for rank 1)
  loader_hang   the rank's data loader sleeps in the user's own function, slow_shard_read()
  regex_spin    the training thread spins in a pathological regular expression, holding the GIL
  sigstop       nothing: the test SIGSTOPs the rank
  raise         the rank raises ValueError in the user's own function, check_batch()
  loss_hang     gradient accumulation: on the micro-batch whose backward launches the
                all-reduce, the rank hangs in its own loss code, compute_loss(), inside the
                backward phase (so it counts as being in the all-reduce)
  own_handler   the job handles the stack signal itself (before the Monitor starts): at step
                --at it waits; the test sends that signal, which must run the job's handler
  none          a healthy run

Every rank writes $LOOP_OUT/rank<N>.json with its pid and the signal it offered for stacks.
"""

import argparse
import json
import os
import re
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from rankscope import Monitor

FAULT_RANK = 1


def slow_shard_read(step: int, fault: bool) -> torch.Tensor:
    """The user's own loader code: a shard read that never returns on the fault rank."""
    if fault:
        time.sleep(3600)
    return torch.randn(16, 32)


def check_batch(step: int, fault: bool) -> None:
    if fault:
        raise ValueError(f"batch {step}: labels out of range (the user's own check)")


def compute_loss(model: nn.Module, x: torch.Tensor, fault: bool) -> torch.Tensor:
    """The user's loss; on the fault rank it hangs computing a term of it."""
    if fault:
        time.sleep(3600)
    return model(x).square().mean()


def spin_in_regex() -> None:
    """Catastrophic backtracking: holds the GIL for hours."""
    re.match(r"(a+)+$", "a" * 64 + "b")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("fault", choices=("loader_hang", "regex_spin", "sigstop", "raise", "loss_hang", "own_handler",
                                     "none"))
    p.add_argument("--at", type=int, default=15)
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument("--step-delay", type=float, default=0.05)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    handled = Path(os.environ.get("LOOP_OUT", ".")) / f"own-handler-ran{rank}"
    if args.fault == "own_handler":
        signal.signal(signal.SIGUSR2, lambda *_: handled.touch())   # the job's own use of SIGUSR2
    monitor = Monitor(device=torch.device("cpu"))
    torch.manual_seed(0)
    model = monitor.watch(DDP(nn.Linear(32, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out = Path(os.environ["LOOP_OUT"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({"pid": os.getpid(),
                                                      "stacks": monitor.parts.registration.stacks}))
    for step in range(args.steps):
        fault = rank == FAULT_RANK and step == args.at
        t0 = time.perf_counter()
        x = slow_shard_read(step, fault and args.fault == "loader_hang")
        monitor.waited_for_data(t0, time.perf_counter())
        with monitor.step(samples=len(x)) as s:
            if fault and args.fault == "regex_spin":
                spin_in_regex()
            check_batch(step, fault and args.fault == "raise")
            if fault and args.fault == "own_handler":
                deadline = time.time() + 60
                while not handled.exists() and time.time() < deadline:
                    time.sleep(0.05)
            with model.no_sync():   # gradient accumulation: the first micro-batch reduces nothing
                with s.phase("backward"):
                    model(x).square().mean().backward()
            with s.phase("backward"):   # the second: its backward launches the all-reduce
                loss = compute_loss(model, x, fault and args.fault == "loss_hang")
                loss.backward()
            with s.phase("optimizer"):
                opt.step()
                opt.zero_grad()
            s.observe(loss=loss)
        time.sleep(args.step_delay)
    monitor.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
