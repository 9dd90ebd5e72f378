"""Where an adapter's time goes: each Lightning hook of ``RankscopeCallback``, timed inside a real fit.

    .venv/bin/python tests/benchmarks/adapter_hooks.py [--steps 1000] [--log-grad-norm]

One process, one CPU thread, Lightning's ``Trainer(accelerator="cpu", devices=1)``
fitting a 3-layer 256-wide MLP (batch 16: a step of a few milliseconds, the
adapters benchmark's model) with ``RankscopeCallback(monitor=m)``, each of whose
hooks is wrapped to add up the wall time spent inside it. Hooks run between the
step's own torch work, with cold caches: the figure is what the hook costs there,
not in a tight loop. ``--log-grad-norm``: the module logs ``grad_norm(self, 2)``
in ``on_before_optimizer_step`` (as Lightning's docs show), so the callback looks
the logged norm up in Lightning's results every step.

Prints microseconds per step for each hook, their sum, and the sum as a share of
the measured step.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit_json, machine  # noqa: E402

HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
         "on_train_batch_end")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--log-grad-norm", action="store_true")
    args = p.parse_args(argv)
    os.environ.setdefault("RANKSCOPE_EXPORTER", "off")
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.utilities import grad_norm
    from torch.utils.data import DataLoader, TensorDataset

    from rankscope import Monitor
    from rankscope.integrations.lightning import RankscopeCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                           torch.nn.ReLU(), torch.nn.Linear(256, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def on_before_optimizer_step(self, optimizer):
            if args.log_grad_norm:
                self.log_dict(grad_norm(self, norm_type=2))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    spent = dict.fromkeys(HOOKS, 0.0)

    class Timed(RankscopeCallback):
        pass

    for name in HOOKS:
        def timed(self, *a, _hook=getattr(RankscopeCallback, name), _name=name, **k):
            t0 = time.perf_counter()
            try:
                return _hook(self, *a, **k)
            finally:
                spent[_name] += time.perf_counter() - t0
        setattr(Timed, name, timed)

    torch.set_num_threads(1)
    metrics_dir = tempfile.TemporaryDirectory(prefix="adapter-hooks-")
    monitor = Monitor(metrics_dir=metrics_dir.name, run="adapter-hooks")
    x = torch.randn(16 * args.steps, 32, generator=torch.Generator().manual_seed(0))
    trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, callbacks=[Timed(monitor=monitor)],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    t0 = time.perf_counter()
    trainer.fit(Module(), DataLoader(TensorDataset(x, x[:, :1] * 2), batch_size=16))
    wall = time.perf_counter() - t0
    monitor.close()
    metrics_dir.cleanup()
    per_step = {k: v / args.steps * 1e6 for k, v in spent.items()}
    total = sum(per_step.values())
    step_us = wall / args.steps * 1e6
    print(f"Lightning hooks of RankscopeCallback, {args.steps} steps, grad-norm logging "
          f"{'on' if args.log_grad_norm else 'off'}:")
    for name, us in per_step.items():
        print(f"  {name:26s} {us:6.1f} us/step")
    print(f"  {'all hooks':26s} {total:6.1f} us/step of a {step_us / 1000:.2f} ms step ({100 * total / step_us:.2f}%)")
    emit_json({"benchmark": "adapter_hooks", "steps": args.steps, "log_grad_norm": args.log_grad_norm,
               "hooks_us": per_step, "total_us": total, "step_us": step_us, "machine": machine()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
