"""A loop with its own metrics, and the mistakes made declaring and setting them.

    python user_metrics.py [STEPS]

Declares, each in try/except, a gauge named "acc²", one with labels
("a", "a"), one with a label "pid"; then a correct gauge
eval_accuracy_ratio (no labels) that it sets to 0.5 and then, by mistake,
with an undeclared label (split="val"). Records every outcome in
$LOOP_OUT/rank0.json; never fails itself.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import rankscope
from rankscope import Monitor


def outcome(fn):
    try:
        fn()
        return {"raised": None}
    except Exception as e:
        config = getattr(rankscope, "ConfigError", None)
        return {"raised": type(e).__name__, "message": str(e),
                "is_rankscope_config_error": bool(config and isinstance(e, config))}


def main() -> int:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    monitor = Monitor(device=torch.device("cpu"))
    result = {
        "bad_name": outcome(lambda: monitor.gauge("acc²", "Accuracy squared")),
        "duplicate_labels": outcome(lambda: monitor.gauge("dup_ratio", "Two labels of one name", labels=("a", "a"))),
        "pid_label": outcome(lambda: monitor.gauge("worker_ratio", "Per worker", labels=("pid",))),
    }
    acc = monitor.gauge("eval_accuracy_ratio", "Held-out accuracy")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(steps):
        x, y = torch.randn(16, 16), torch.randint(0, 4, (16,))
        with monitor.step(samples=16) as step:
            with step.phase("forward"):
                loss = F.cross_entropy(model(x), y)
            with step.phase("backward"):
                loss.backward()
            with step.phase("optimizer"):
                opt.step()
                opt.zero_grad()
            step.observe(loss=loss.detach())
    acc.set(0.5)
    result["undeclared_label"] = outcome(lambda: acc.set(1.0, split="val"))
    result["steps"] = steps

    out = Path(os.environ.get("LOOP_OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "rank0.json").write_text(json.dumps(result))
    monitor.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
