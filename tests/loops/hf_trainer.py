"""A real Hugging Face Trainer job with rankscope's two lines (run under torchrun, CPU, gloo).

    torchrun --standalone --nproc-per-node 2 hf_trainer.py [--steps N] [--save-every N]
        [--nan-rank R --nan-step S] [--oom-rank R --oom-step S] [--hang-rank R --hang-step S]

A 2-layer GPT-2 (64 hidden) built from its config, nothing fetched
(HF_HUB_OFFLINE=1); a synthetic token dataset whose collate takes
COLLATE_S per batch; gradient accumulation 2; a checkpoint every SAVE_EVERY
steps. On ``--nan-rank`` the loss of step ``--nan-step`` reads NaN (its
gradient stays finite, so the other rank trains on: only that rank's loss is
non-finite); on ``--oom-rank`` the forward of step ``--oom-step`` raises
torch.OutOfMemoryError; on ``--hang-rank`` the first micro-batch's forward of
step ``--hang-step`` never returns (its peers block in the step's all-reduce). Each rank writes what the Trainer itself saw to
$LOOP_OUT/rank<N>.json: its global_step, train_runtime, and its own loss per
optimizer step (the sum of its training_step returns, each already divided by
the accumulation count).
"""

import argparse
import hashlib
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from rankscope.integrations.hf import RankscopeCallback, instrument  # noqa: E402

VOCAB, SEQ = 256, 32
COLLATE_S = 0.01
ACCUMULATE = 2
BATCH = 4


class Tokens(Dataset):
    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def collate(rows):
    time.sleep(COLLATE_S)   # tokenisation, packing...
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


class RecordingTrainer(Trainer):
    """The Trainer's own view of this rank's loss (and the injected NaN)."""

    def __init__(self, *a, faults=None, **k):
        super().__init__(*a, **k)
        self.own_loss = defaultdict(float)
        self.faults = faults

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        rank, step = self.args.process_index, self.state.global_step
        if rank == self.faults.oom_rank and step == self.faults.oom_step:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        if rank == self.faults.hang_rank and step == self.faults.hang_step:
            time.sleep(3600)   # a deadlock, a stuck file system...
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if rank == self.faults.nan_rank and step == self.faults.nan_step:
            # The value reads NaN; the gradient is the real loss's (the other rank trains on).
            loss = loss + (torch.tensor(float("nan")) - loss.detach())
        return loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.own_loss[self.state.global_step] += float(loss)
        return loss


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=30)
    for fault in ("nan", "oom", "hang"):
        p.add_argument(f"--{fault}-rank", type=int, default=-1)
        p.add_argument(f"--{fault}-step", type=int, default=-1)
    args = p.parse_args()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2))
    out = Path(os.environ["LOOP_OUT"])   # the test's own directory: the checkpoints go with it
    out_dir = str(out / "trainer-output")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    training = TrainingArguments(
        output_dir=out_dir, max_steps=args.steps, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE, learning_rate=1e-3, logging_steps=10,
        save_strategy="steps", save_steps=args.save_every, save_only_model=True, report_to="none",
        use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0, seed=0, disable_tqdm=True)
    trainer = RecordingTrainer(model=model, args=training,
                               train_dataset=Tokens(args.steps * ACCUMULATE * BATCH * world),
                               data_collator=collate, callbacks=[RankscopeCallback()],
                               faults=args)
    instrument(trainer)
    result = trainer.train()
    rank = trainer.args.process_index
    params = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    weights = hashlib.sha256(b"".join(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                                      for p in model.parameters())).hexdigest()
    monitors = [c.monitor for c in trainer.callback_handler.callbacks if getattr(c, "monitor", None) is not None]
    replica_checked = bool(monitors) and monitors[0].parts.watched.replica_check is not None
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "global_step": trainer.state.global_step, "train_runtime": result.metrics["train_runtime"],
        "own_loss": {str(k): v for k, v in sorted(trainer.own_loss.items())}, "param_bytes": params,
        "weights_sha256": weights, "replica_checked": replica_checked,
        "nan_step": args.nan_step if rank == args.nan_rank else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
