"""ReduceLROnPlateau on a validation loss that does not improve: the LR halves every other step.

    python plateau.py float|list [STEPS]

float  reports lr=opt.param_groups[0]["lr"]
list   reports lr=sched.get_last_lr() (a list, one per param group)

The scheduler steps inside the monitored step, before observe(), so the LR
reported at a step is the optimizer's LR when the step ends. Writes the
LRs it reported and the optimizer's final LR to $LOOP_OUT/rank<N>.json.
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


def main() -> int:
    mode = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    assert mode in ("float", "list"), mode
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # Random labels: the validation loss cannot halve, so every "patience" steps the LR is cut.
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=1, threshold=0.5)
    data = TensorDataset(torch.randn(steps * 16, 16), torch.randint(0, 4, (steps * 16,)))
    loader = DataLoader(data, batch_size=16, shuffle=True)
    val_x, val_y = torch.randn(64, 16), torch.randint(0, 4, (64,))

    monitor = Monitor(device=torch.device("cpu"))
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

    rank = int(os.environ.get("RANK", "0"))
    out = Path(os.environ.get("LOOP_OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "mode": mode, "steps": len(reported), "reported_lrs": reported, "final_lr": opt.param_groups[0]["lr"],
        "initial_lr": 0.1}))
    print(f"lr {reported[0]} -> {reported[-1]} over {len(reported)} steps", flush=True)
    monitor.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
