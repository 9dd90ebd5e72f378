"""Mistakes a user makes with the Monitor, each in an otherwise ordinary loop.

    python misuse.py CHECK [CHECK ...]

CHECK
  nested  a step opened inside another step
  second  a second Monitor while the first is open (both on the run of $RANKSCOPE_RUN)
  reopen  a new Monitor (run "<run>-2") after monitor.close()
  late    step.observe() on a step that has ended

Each CHECK is its own training run, one after the other, with its own
Monitor (run "<RANKSCOPE_RUN>-<CHECK>", but "second": "<RANKSCOPE_RUN>"),
closed before the next check.
Never fails itself: it records what happened (the exception raised, if any,
and the values it reported) in $LOOP_OUT/<CHECK>/rank0.json for the test
to judge.
"""

import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import rankscope
from rankscope import Monitor

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05)


def batches(n):
    for _ in range(n):
        yield torch.randn(16, 16), torch.randint(0, 4, (16,))


def train_step(step, x, y):
    with step.phase("forward"):
        loss = F.cross_entropy(model(x), y)
    with step.phase("backward"):
        loss.backward()
    with step.phase("optimizer"):
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss.detach(), norm


def train(monitor, n):
    last = {}
    for x, y in monitor.data(batches(n)):
        with monitor.step(samples=len(x)) as step:
            loss, norm = train_step(step, x, y)
            lr = opt.param_groups[0]["lr"]
            step.observe(loss=loss, grad_norm=norm, lr=lr)
            last = {"loss": loss.item(), "grad_norm": norm.item(), "lr": lr}
    return step, last


def describe(e):
    usage = getattr(rankscope, "UsageError", None)
    config = getattr(rankscope, "ConfigError", None)
    return {"type": type(e).__name__, "module": type(e).__module__, "message": str(e),
            "is_runtime_error": isinstance(e, RuntimeError),
            "is_rankscope_usage_error": bool(usage and isinstance(e, usage)),
            "is_rankscope_config_error": bool(config and isinstance(e, config)),
            "traceback": traceback.format_exc()[-2000:]}


def nested(result, run):
    monitor = Monitor(device=torch.device("cpu"), run=run)
    try:
        train(monitor, 5)
        result["inner_body_ran"] = False
        result["error"] = None
        try:
            with monitor.step(samples=16) as outer:
                x, y = next(batches(1))
                train_step(outer, x, y)
                with monitor.step(samples=16) as inner:   # the mistake
                    result["inner_body_ran"] = True
                    train_step(inner, x, y)
        except Exception as e:
            result["error"] = describe(e)
        train(monitor, 5)
        result["good_steps"] = 10
    finally:
        monitor.close()


def second(result, run):
    first = Monitor(device=torch.device("cpu"), run=run)
    try:
        train(first, 5)
        result["error"] = None
        try:
            other = Monitor(device=torch.device("cpu"))   # the mistake: e.g. a helper module made its own
            other.close()
        except Exception as e:
            result["error"] = describe(e)
        train(first, 5)
        result["good_steps"] = 10
    finally:
        first.close()


def reopen(result, run):
    first = Monitor(device=torch.device("cpu"), run=run)
    try:
        train(first, 5)
    finally:
        first.close()
    result["first_steps"] = 5
    result["error"] = None
    try:
        again = Monitor(device=torch.device("cpu"), run=run + "-2")   # fine-tuning phase
        try:
            train(again, 7)
        finally:
            again.close()
        result["second_steps"] = 7
    except Exception as e:
        result["error"] = describe(e)


def late(result, run):
    monitor = Monitor(device=torch.device("cpu"), run=run)
    try:
        step, last = train(monitor, 10)
        result["last"] = last
        result["error"] = None
        try:
            step.observe(loss=123.0, grad_norm=456.0, lr=7.0)   # the mistake: after its step ended
        except Exception as e:
            result["error"] = describe(e)
    finally:
        monitor.close()


CHECKS = {"nested": nested, "second": second, "reopen": reopen, "late": late}


def main() -> int:
    checks = sys.argv[1:]
    assert checks and all(check in CHECKS for check in checks), checks
    for check in checks:
        result = {"check": check}
        # "second" keeps the run of the environment: the helper's Monitor would get that one too
        base = os.environ.get("RANKSCOPE_RUN", "misuse")
        try:
            CHECKS[check](result, base if check == "second" else f"{base}-{check}")
        except Exception as e:
            result["unexpected"] = describe(e)
        out = Path(os.environ.get("LOOP_OUT", ".")) / check
        out.mkdir(parents=True, exist_ok=True)
        (out / "rank0.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
