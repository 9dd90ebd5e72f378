"""Small models and modules the CUDA-rule tests train, on the CPU under the strict double and on a GPU."""

from __future__ import annotations

from typing import Any

import torch


def faults(monitor: Any) -> dict[str, float]:
    """The rank's telemetry errors and drops that are not zero, by component or kind."""
    m = monitor.parts.metrics
    counted = {f"error:{k}": c._value.get() for k, c in m.errors.items()}
    counted.update({f"drop:{k}": c._value.get() for k, c in m.drops.items()})
    return {k: v for k, v in counted.items() if v}


def lightning_module(pl: Any, width: int, hidden: int | None = None) -> Any:
    """A LightningModule that logs its loss and its gradient norms with ``prog_bar=True``, as
    Lightning's docs show (``grad_norm`` in ``on_before_optimizer_step``)."""
    from lightning.pytorch.utilities import grad_norm

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = (torch.nn.Linear(width, 1) if hidden is None else
                        torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss, prog_bar=True)
            return loss

        def on_before_optimizer_step(self, optimizer):
            self.log_dict(grad_norm(self, norm_type=2), prog_bar=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return Regression()
