"""A real Lightning job with rankscope's one line: Trainer(accelerator="cpu", devices=2, strategy="ddp").

    python lightning_trainer.py [--steps N] [--checkpoint-every N] [--val-every N]
        [--nan-rank R --nan-step S] [--oom-rank R --oom-step S] [--hang-rank R --hang-step S]

Lightning starts the second rank itself (its subprocess launcher), gloo on
127.0.0.1. A small MLP on synthetic regression data whose collate takes
COLLATE_S per batch; with ``--checkpoint-every N`` a checkpoint every N steps
(each write takes at least SAVE_S, as a large model's does), with ``--val-every N``
a validation every N steps (VAL_BATCHES batches of at least VAL_BATCH_S each).
On ``--nan-rank`` the loss of step ``--nan-step`` reads NaN (its gradient
stays finite, so the other rank trains on); on ``--oom-rank`` step
``--oom-step`` raises torch.OutOfMemoryError in training_step; on
``--hang-rank`` training_step of step ``--hang-step`` never returns. Each rank
writes what Lightning itself saw to $LOOP_OUT/rank<N>.json: its global_step,
the Timer callback's training time, its own loss and the gradient norm it
logged (Lightning's grad_norm utility) per step, and the seconds its checkpoint
writes and validations took, timed around them.
"""

import argparse
import hashlib
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.dataloader import default_collate

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint, Timer
    from lightning.pytorch.plugins.io import TorchCheckpointIO
    from lightning.pytorch.utilities import grad_norm
except ImportError:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint, Timer
    from pytorch_lightning.plugins.io import TorchCheckpointIO
    from pytorch_lightning.utilities import grad_norm

from rankscope.integrations.lightning import RankscopeCallback

COLLATE_S = 0.01
SAVE_S = 0.3
VAL_BATCHES, VAL_BATCH_S = 4, 0.1
BATCH = 16
HIDDEN = 256
LR = 0.05


def collate(rows):
    time.sleep(COLLATE_S)   # decoding, augmentation...
    return default_collate(rows)


class TimedCheckpointIO(TorchCheckpointIO):
    """Lightning's own checkpoint writer, each write timed (and made SAVE_S long at least)."""

    def __init__(self):
        super().__init__()
        self.seconds = 0.0

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        t0 = time.perf_counter()
        super().save_checkpoint(checkpoint, path, storage_options)
        time.sleep(max(SAVE_S - (time.perf_counter() - t0), 0.0))
        self.seconds += time.perf_counter() - t0


class Regression(pl.LightningModule):
    def __init__(self, nan_rank=-1, nan_step=-1, oom_rank=-1, oom_step=-1, hang_rank=-1, hang_step=-1):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                                 nn.Linear(HIDDEN, 1))
        self.own_loss = defaultdict(float)
        self.own_grad_norm = {}
        self.faults = (nan_rank, nan_step, oom_rank, oom_step, hang_rank, hang_step)
        self.validation_s = 0.0
        self.validations = 0
        self._validation_t0 = 0.0

    def validation_step(self, batch, batch_idx):
        time.sleep(VAL_BATCH_S)
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y), sync_dist=True)

    def on_validation_start(self):
        self._validation_t0 = time.perf_counter()

    def on_validation_end(self):
        self.validation_s += time.perf_counter() - self._validation_t0
        self.validations += 1

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        nan_rank, nan_step, oom_rank, oom_step, hang_rank, hang_step = self.faults
        rank, step = self.trainer.global_rank, self.trainer.global_step
        if rank == hang_rank and step == hang_step:
            time.sleep(3600)   # a deadlock, a stuck file system...
        if rank == oom_rank and step == oom_step:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        if rank == nan_rank and step == nan_step:
            # The value reads NaN; the gradient is the real loss's (the other rank trains on).
            loss = loss + (torch.tensor(float("nan")) - loss.detach())
        self.own_loss[step] += float(loss)
        return loss

    def on_before_optimizer_step(self, optimizer):
        # Lightning's recipe for logging gradient norms; rankscope reads the total.
        norms = grad_norm(self, norm_type=2)
        self.own_grad_norm[self.trainer.global_step] = float(norms["grad_2.0_norm_total"])
        self.log_dict(norms)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)
        # Halved every 10 steps: step S trains at LR * 0.5 ** (S // 10).
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N", help="a checkpoint every N steps")
    p.add_argument("--val-every", type=int, default=0, metavar="N", help="a validation every N steps")
    for fault in ("nan", "oom", "hang"):
        p.add_argument(f"--{fault}-rank", type=int, default=-1)
        p.add_argument(f"--{fault}-step", type=int, default=-1)
    args = p.parse_args()
    torch.set_num_threads(1)   # two ranks share two cores
    pl.seed_everything(0, verbose=False)
    n = args.steps * BATCH * 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    data = TensorDataset(x, x[:, :1] * 2 + 0.1 * torch.randn(n, 1, generator=g))
    loader = DataLoader(data, batch_size=BATCH, collate_fn=collate, shuffle=False)
    module = Regression(args.nan_rank, args.nan_step, args.oom_rank, args.oom_step, args.hang_rank, args.hang_step)
    timer = Timer()
    callbacks = [RankscopeCallback(), timer]
    if args.checkpoint_every:
        callbacks.append(ModelCheckpoint(every_n_train_steps=args.checkpoint_every, save_top_k=-1))
    checkpoint_io = TimedCheckpointIO()
    validation, val_loader = {}, None
    if args.val_every:
        val = TensorDataset(x[:VAL_BATCHES * BATCH], data.tensors[1][:VAL_BATCHES * BATCH])
        val_loader = DataLoader(val, batch_size=BATCH)
        validation = dict(val_check_interval=args.val_every, check_val_every_n_epoch=None)
    out = Path(os.environ["LOOP_OUT"])   # the test's own directory: the Trainer's files go with it
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=args.steps, max_epochs=1,
                         callbacks=callbacks, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         enable_checkpointing=bool(args.checkpoint_every), plugins=[checkpoint_io],
                         default_root_dir=str(out / f"trainer-output-{os.environ.get('RANK', '0')}"), **validation)
    trainer.fit(module, loader, val_dataloaders=val_loader)
    rank = trainer.global_rank
    params = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    weights = hashlib.sha256(b"".join(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                                      for p in module.parameters())).hexdigest()
    monitors = [c.monitor for c in callbacks if getattr(c, "monitor", None) is not None]
    replica_checked = bool(monitors) and monitors[0].parts.watched.replica_check is not None
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "global_step": trainer.global_step, "train_time": timer.time_elapsed("train"),
        "own_loss": {str(k): v for k, v in sorted(module.own_loss.items())}, "param_bytes": params,
        "weights_sha256": weights, "replica_checked": replica_checked,
        "own_grad_norm": {str(k): v for k, v in sorted(module.own_grad_norm.items())},
        "checkpoint_write_s": checkpoint_io.seconds, "validation_s": module.validation_s,
        "validations": module.validations}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
