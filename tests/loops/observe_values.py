"""A small classifier that reports loss, gradient norm and learning rate in
the shapes a real loop has at hand, not only as Python floats.

    python observe_values.py KIND [KIND ...] [--steps STEPS]

KIND
  loss_per_sample  the loss with reduction="none": one value per sample (16)
  grad_per_group   one gradient norm per param group (clip_grad_norm_ per group), as a list
  lr_list          scheduler.get_last_lr(): one learning rate per param group, as a list
  loss_text        a formatted log string instead of the loss (a mistake)
  grad_dict        a dict of named gradient norms instead of one number (a mistake)

Each KIND is its own training run, one after the other, with its own Monitor
(run "<RANKSCOPE_RUN>-<KIND>"), closed before the next one opens. Once it
is closed, writes what it reported at the run's last step to
$LOOP_OUT/<KIND>/rank<N>.json.
With $LOOP_HOLD set (a directory) it waits, after a run's last step and
before closing its monitor, until $LOOP_HOLD/<KIND> exists (so a test can
look at the exporter mid-run); it says so with $LOOP_OUT/<KIND>/holding<N>.
"""

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from rankscope import Monitor

KINDS = ("loss_per_sample", "grad_per_group", "lr_list", "loss_text", "grad_dict")


def train(kind: str, steps: int, rank: int) -> None:
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
    head = nn.Linear(32, 4)
    opt = torch.optim.SGD([{"params": encoder.parameters(), "lr": 0.1},
                           {"params": head.parameters(), "lr": 0.01}], momentum=0.9)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.97)
    data = TensorDataset(torch.randn(steps * 16, 16), torch.randint(0, 4, (steps * 16,)))
    loader = DataLoader(data, batch_size=16, shuffle=True)

    monitor = Monitor(device=torch.device("cpu"), run=f"{os.environ.get('RANKSCOPE_RUN', 'values')}-{kind}")
    reported: dict = {}
    for x, y in monitor.data(loader):
        with monitor.step(samples=len(x)) as step:
            with step.phase("forward"):
                per_sample = F.cross_entropy(head(encoder(x)), y, reduction="none")
                loss = per_sample.mean()
            with step.phase("backward"):
                loss.backward()
            with step.phase("optimizer"):
                norms = [torch.nn.utils.clip_grad_norm_(group["params"], max_norm=5.0) for group in opt.param_groups]
                opt.step()
                opt.zero_grad(set_to_none=True)
            total_norm = torch.linalg.vector_norm(torch.stack(norms))
            lrs = sched.get_last_lr()
            if kind == "loss_per_sample":
                step.observe(loss=per_sample.detach(), grad_norm=total_norm, lr=lrs[0])
                reported = {"loss": per_sample.detach().mean().item(), "grad_norm": total_norm.item(), "lr": lrs[0]}
            elif kind == "grad_per_group":
                step.observe(loss=loss.detach(), grad_norm=norms, lr=lrs[0])
                reported = {"loss": loss.item(), "grad_norm": math.sqrt(sum(n.item() ** 2 for n in norms)),
                            "lr": lrs[0]}
            elif kind == "lr_list":
                step.observe(loss=loss.detach(), grad_norm=total_norm, lr=lrs)
                reported = {"loss": loss.item(), "grad_norm": total_norm.item(), "lr": lrs[0], "lrs": lrs}
            elif kind == "loss_text":
                step.observe(loss=f"loss={loss.item():.4f}", grad_norm=total_norm, lr=lrs[0])
                reported = {"grad_norm": total_norm.item(), "lr": lrs[0], "unreadable_per_step": 1}
            else:  # grad_dict
                step.observe(loss=loss.detach(), grad_norm={"encoder": norms[0].item(), "head": norms[1].item()},
                             lr=lrs[0])
                reported = {"loss": loss.item(), "lr": lrs[0], "unreadable_per_step": 1}
        sched.step()

    out = Path(os.environ.get("LOOP_OUT", ".")) / kind
    out.mkdir(parents=True, exist_ok=True)
    hold = os.environ.get("LOOP_HOLD")
    if hold:
        (out / f"holding{rank}").touch()
        deadline = time.monotonic() + 60
        while not (Path(hold) / kind).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    monitor.close()
    (out / f"rank{rank}.json").write_text(json.dumps({"kind": kind, "steps": steps, "last": reported}))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("kinds", nargs="+", choices=KINDS, metavar="KIND")
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    for kind in args.kinds:
        train(kind, args.steps, rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
