"""ReduceLROnPlateau on a validation loss that does not improve: the LR halves every other step.

    python plateau.py MODE[,MODE...] [STEPS]

MODE
  float  reports lr=opt.param_groups[0]["lr"]
  list   reports lr=sched.get_last_lr() (a list, one per param group)

Each MODE is its own training run, one after the other, with its own
Monitor (run "<RANKSCOPE_RUN>-<MODE>"), closed before the next one opens.
The scheduler steps inside the monitored step, before observe(), so the LR
reported at a step is the optimizer's LR when the step ends. Once the run's
monitor is closed, writes the LRs it reported and the optimizer's final LR
to $LOOP_OUT/<MODE>/rank<N>.json.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from rankscope import Monitor


def train(mode: str, steps: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # Random labels: the validation loss cannot halve, so every "patience" steps the LR is cut.
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=1, threshold=0.5)
    data = TensorDataset(torch.randn(steps * 16, 16), torch.randint(0, 4, (steps * 16,)))
    loader = DataLoader(data, batch_size=16, shuffle=True)
    val_x, val_y = torch.randn(64, 16), torch.randint(0, 4, (64,))

    monitor = Monitor(device=torch.device("cpu"), run=f"{os.environ.get('RANKSCOPE_RUN', 'plateau')}-{mode}")
    reported = []
    for x, y in monitor.data(loader):
        with monitor.step(samples=len(x)) as step:
            with step.phase("forward"):
                loss = F.cross_entropy(model(x), y)
            with step.phase("backward"):
                loss.backward()
            with step.phase("optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                val_loss = F.cross_entropy(model(val_x), val_y).item()
            sched.step(val_loss)
            lr = opt.param_groups[0]["lr"] if mode == "float" else sched.get_last_lr()
            step.observe(loss=loss.detach(), lr=lr)
            reported.append(lr if mode == "float" else lr[0])

    monitor.close()

    rank = int(os.environ.get("RANK", "0"))
    out = Path(os.environ.get("LOOP_OUT", ".")) / mode
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "mode": mode, "steps": len(reported), "reported_lrs": reported, "final_lr": opt.param_groups[0]["lr"],
        "initial_lr": 0.1}))
    print(f"{mode}: lr {reported[0]} -> {reported[-1]} over {len(reported)} steps", flush=True)


def main() -> int:
    modes = sys.argv[1].split(",")
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    assert all(mode in ("float", "list") for mode in modes), modes
    for mode in modes:
        train(mode, steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
