"""The reference job: a real distributed training run, instrumented with rankscope.

    torchrun --standalone --nproc-per-node 2 -m rankscope.train --steps 600 --metrics-port 9400
    torchrun --standalone --nproc-per-node 2 -m rankscope.train --parallelism fsdp2
    torchrun --standalone --nproc-per-node 4 -m rankscope.train --parallelism 2d --tp-size 2

Parallelism: ``ddp`` (DistributedDataParallel), ``fsdp2`` (``fully_shard`` on
every linear layer and the root), ``hsdp`` (the same over a 2-D mesh: two replicas,
each sharded over half the world), ``2d`` (a data-parallel x tensor-parallel
device mesh: the linear layers sharded over ``tp`` with DTensor, then
``fully_shard`` over ``dp``), ``pipeline`` (the layers split into ``--stages``
pipeline stages, each data-parallel over world/stages ranks; micro-batches
passed between stages with send/recv, GPipe order).

A student MLP learns to imitate a fixed random "teacher" network on synthetic
data: the loss falls within a minute on two CPU cores, and a periodic
evaluation reports accuracy as a custom metric. gloo on CPU, NCCL on GPU.

Fault injection (each targets ``--fault-rank``, default the last rank) makes
the pathologies rankscope must catch happen for real: a NaN loss, a loss
spike, an out-of-memory error, a crash, a hang before a collective, a slow
rank, a slow data pipeline, and replicas that leave each other: a flipped bit in
one rank's weights, a step under ``no_sync()`` on one rank, a rank starting from
weights of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from rankscope.config import ConfigError
from rankscope.flops import FlopsConfig
from rankscope.monitor import Monitor

IN_FEATURES, CLASSES = 32, 10
PARALLELISMS = ("ddp", "fsdp2", "hsdp", "2d", "pipeline")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rankscope-train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=600, help="training steps (default 600)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve the node's /metrics on this port (default 9400)")
    p.add_argument("--run-id", default=None, help="run label (default: torchrun's run id)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--samples", type=int, default=32768, help="training set size")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--workers", type=int, default=1, help="data loader worker processes")
    p.add_argument("--print-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parallelism", choices=PARALLELISMS, default="ddp",
                   help="ddp (default), fsdp2 (fully_shard), hsdp (fully_shard over 2 replicas x half the world), "
                        "or 2d (data parallel x tensor parallel mesh)")
    p.add_argument("--tp-size", type=int, default=2, help="2d: ranks per tensor-parallel group (default 2)")
    p.add_argument("--stages", type=int, default=2, help="pipeline: pipeline stages (default 2)")
    p.add_argument("--micro-batches", type=int, default=2, help="pipeline: micro-batches per step (default 2)")
    p.add_argument("--stage-cost", default=None, metavar="C0,C1,...",
                   help="pipeline: each stage's share of --step-delay, as its layers would make it (default 1 each; "
                        "1,1.6: the second stage holds 1.6x the layers)")
    p.add_argument("--comm-debug", action="store_true",
                   help="count every step's and evaluation's collectives with torch's CommDebugMode and print the "
                        "totals at the end (a check of what rankscope counts; slows the steps)")
    p.add_argument("--bucket-cap-mb", type=float, default=0.1,
                   help="DDP gradient bucket size (small by default so the small model has several buckets)")
    p.add_argument("--step-delay", type=float, default=0.0, help="extra seconds per step on every rank (longer runs)")
    p.add_argument("--checkpoint-dir", type=Path, default=None,
                   help="save the step reached here at each checkpoint; --resume starts from it")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N", help="checkpoint every N steps (0: never)")
    p.add_argument("--resume", action="store_true", help="start from the step saved in --checkpoint-dir")
    n = p.add_argument_group("the noise of a healthy run (for quiet-alert drills)")
    n.add_argument("--jitter", type=float, default=0.0, metavar="R", help="vary --step-delay by +-R (0.2: +-20%%)")
    n.add_argument("--uneven-work", action="store_true",
                   help="each rank's batch of each step has its own length: --step-delay times 0.2-1.0 of the "
                        "longest, drawn per rank and step (mean 1x), as unpacked sequences of random length make it")
    n.add_argument("--dropout", type=float, default=0.0, metavar="P", help="dropout after each hidden layer")
    n.add_argument("--loss-noise", type=float, default=0.0, metavar="R", help="multiply the loss by 1 +- R")
    n.add_argument("--eval-pause", type=float, default=0.0, metavar="S", help="extra seconds per evaluation")
    n.add_argument("--checkpoint-pause", type=float, default=0.0, metavar="S", help="seconds each checkpoint takes")
    n.add_argument("--save-on-rank0-only", action="store_true",
                   help="only rank 0 saves, spending the pause inside monitor.checkpoint(); the others wait for it "
                   "in a barrier outside any block, as loops that save on rank 0 do (ddp)")
    f = p.add_argument_group("fault injection")
    f.add_argument("--fault-rank", type=int, default=None, help="rank the faults target (default: the last rank)")
    f.add_argument("--all-ranks", action="store_true", help="the faults target every rank")
    f.add_argument("--nan-loss-at", type=int, default=None, metavar="STEP", help="make the loss NaN at STEP")
    f.add_argument("--loss-spike-at", type=int, default=None, metavar="STEP", help="multiply the loss by 50 at STEP")
    f.add_argument("--loss-spikes-from", type=int, default=None, metavar="STEP",
                   help="multiply the loss by 50 at STEP and every 10 steps after, 5 times")
    f.add_argument("--diverge-from", type=int, default=None, metavar="STEP",
                   help="from STEP on, the loss grows by 1%% of its level per step (a divergence trend)")
    f.add_argument("--leak-mb-per-step", type=float, default=0.0, metavar="MB",
                   help="from --leak-from on, keep MB more host memory per step (memory creep)")
    f.add_argument("--leak-from", type=int, default=0, metavar="STEP")
    f.add_argument("--leak-max-mb", type=float, default=2048.0, metavar="MB", help="stop leaking at this total")
    f.add_argument("--oom-at", type=int, default=None, metavar="STEP", help="raise an out-of-memory error at STEP")
    f.add_argument("--crash-at", type=int, default=None, metavar="STEP", help="SIGKILL the rank at STEP")
    f.add_argument("--device-error-at", type=int, default=None, metavar="STEP",
                   help="raise the error torch raises for a faulty GPU (an illegal memory access) at STEP")
    f.add_argument("--raise-at", type=int, default=None, metavar="STEP",
                   help="raise an exception (a data error) in the loop at STEP")
    f.add_argument("--hang-at", type=int, default=None, metavar="STEP", help="hang before the collective of STEP")
    f.add_argument("--flip-bit-at", type=int, default=None, metavar="STEP",
                   help="flip one bit of one weight (2.weight's first element of this rank's copy or shard) after "
                        "the optimizer step of STEP: a silently corrupting GPU")
    f.add_argument("--no-sync-at", type=int, default=None, metavar="STEP",
                   help="ddp: run STEP's forward and backward under no_sync() on this rank only")
    f.add_argument("--resume-perturbed", type=float, default=0.0, metavar="EPS",
                   help="start from weights EPS off the others' (a checkpoint of its own, loaded into the wrapped "
                        "model after DDP's broadcast)")
    f.add_argument("--slow-rank-delay", type=float, default=0.0, metavar="S", help="extra compute seconds per step")
    f.add_argument("--slow-data-delay", type=float, default=0.0, metavar="S", help="extra seconds per batch load")
    f.add_argument("--late-init", type=float, default=0.0, metavar="S",
                   help="spend S seconds in the rank's own start-up before init_process_group (data, model building)")
    f.add_argument("--init-error", action="store_true",
                   help="call init_process_group with a misspelt backend: it raises, the rank fails in start-up")
    f.add_argument("--late-first-step", type=float, default=0.0, metavar="S",
                   help="spend S seconds after init_process_group before the first collective (a checkpoint "
                   "load, a first compile)")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "hidden", "samples", "eval_every", "print_every"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if min(args.workers, args.slow_rank_delay, args.slow_data_delay, args.step_delay, args.eval_pause,
           args.checkpoint_pause, args.checkpoint_every, args.leak_mb_per_step, args.late_init,
           args.late_first_step) < 0:
        p.error("--workers, delays, pauses and sizes must be >= 0")
    if not 0 <= args.jitter < 1 or not 0 <= args.loss_noise < 1:
        p.error("--jitter and --loss-noise must be in [0, 1)")
    if (args.resume or args.checkpoint_every) and args.checkpoint_dir is None:
        p.error("--resume and --checkpoint-every need --checkpoint-dir")
    if min(args.tp_size, args.stages, args.micro_batches) < 1:
        p.error("--tp-size, --stages and --micro-batches must be >= 1")
    try:
        args.stage_cost = [float(c) for c in args.stage_cost.split(",")] if args.stage_cost else [1.0] * args.stages
    except ValueError:
        p.error(f"--stage-cost {args.stage_cost!r}: expected numbers separated by commas")
    if args.save_on_rank0_only and args.parallelism != "ddp":
        p.error("--save-on-rank0-only: only the ddp job saves on one rank (sharded jobs save on every rank)")
    if args.parallelism == "pipeline" and args.checkpoint_every:
        p.error("--checkpoint-every: the pipeline job does not checkpoint")
    if len(args.stage_cost) != args.stages or min(args.stage_cost) <= 0:
        p.error(f"--stage-cost: one number > 0 per stage ({args.stages})")
    if args.metrics_port is not None and not 0 < args.metrics_port < 65536:
        p.error(f"--metrics-port {args.metrics_port} is not a TCP port (1-65535)")
    return args


class TeacherDataset(Dataset):
    """Inputs from a fixed Gaussian, labels from a fixed random teacher MLP."""

    def __init__(self, n: int, seed: int, split: str, slow_delay: float = 0.0):
        g = torch.Generator().manual_seed(seed)
        teacher = nn.Sequential(nn.Linear(IN_FEATURES, 64), nn.Tanh(), nn.Linear(64, CLASSES))
        with torch.no_grad():
            for param in teacher.parameters():
                param.copy_(torch.randn(param.shape, generator=g) * 1.5)
            inputs = torch.Generator().manual_seed(seed * 1000 + (1 if split == "train" else 2))
            self.x = torch.randn(n, IN_FEATURES, generator=inputs)
            self.y = teacher(self.x).argmax(dim=1)
        self.slow_delay = slow_delay

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]

    def collate(self, batch):
        if self.slow_delay:
            time.sleep(self.slow_delay)
        xs, ys = zip(*batch)
        return torch.stack(xs), torch.stack(ys)


def build_model(hidden: int, dropout: float = 0.0) -> nn.Module:
    """Linear layers at indices 0, 2 and 4 (the tensor-parallel plan names them); a dropout sits
    inside the activation's slot."""
    def activation() -> nn.Module:
        return nn.Sequential(nn.ReLU(), nn.Dropout(dropout)) if dropout else nn.ReLU()

    return nn.Sequential(nn.Linear(IN_FEATURES, hidden), activation(), nn.Linear(hidden, hidden), activation(),
                         nn.Linear(hidden, CLASSES))


def parallelize(args: argparse.Namespace, monitor: Monitor, device: torch.device) -> tuple[nn.Module, int, int]:
    """The model as ``--parallelism`` shards it, with this rank's data-parallel rank and size.

    fsdp2 and 2d need nothing from rankscope beyond the Monitor: torch's flight
    recorder shows it their collectives (rankscope.collectives.process_groups)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(args.hidden, args.dropout).to(device)
    if args.parallelism == "ddp":
        cuda = device.type == "cuda"
        return monitor.watch(DDP(model, device_ids=[device.index] if cuda else None,
                                 bucket_cap_mb=args.bucket_cap_mb)), rank, world
    if args.parallelism == "pipeline":
        stage = PipelineStageModel(build_model(args.hidden).to(device), args.stages, rank, world)
        monitor.watch(stage.module)
        return stage, stage.replica, stage.replicas
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if args.parallelism in ("fsdp2", "hsdp"):   # hsdp: 2 replicas, each sharded over half the world
        if args.parallelism == "hsdp" and world % 2:
            raise SystemExit(f"rankscope-train: --parallelism hsdp needs an even world size, not {world}")
        shape, names = (((world,), ("dp_shard",)) if args.parallelism == "fsdp2"
                        else ((2, world // 2), ("dp_replicate", "dp_shard")))
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        return monitor.watch(fully_shard(model, mesh=mesh)), rank, world
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if world % args.tp_size:
        raise SystemExit(f"rankscope-train: --tp-size {args.tp_size} does not divide the world size {world}")
    dp = world // args.tp_size
    mesh = init_device_mesh(device.type, (dp, args.tp_size), mesh_dim_names=("dp", "tp"))
    # Megatron-style: the first layer column-wise, the second row-wise (one all-reduce),
    # the classifier column-wise with its output gathered.
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel(),
                                           "4": ColwiseParallel(output_layouts=Replicate())})
    fully_shard(model, mesh=mesh["dp"])
    return monitor.watch(model), mesh["dp"].get_local_rank(), dp


class PipelineStageModel:
    """This rank's stage of the model, split at its linear layers into ``stages`` stages, each
    data-parallel over ``world / stages`` ranks: rank r holds stage ``r // replicas`` of replica
    ``r % replicas``. The layout is stated to rankscope in one line, as a launcher that places
    stages would (``RANKSCOPE_LAYOUT``, or ``Monitor(layout=...)``)."""

    def __init__(self, model: nn.Sequential, stages: int, rank: int, world: int):
        cuts = [i for i, layer in enumerate(model) if isinstance(layer, nn.Linear)]
        if stages > len(cuts) or world % stages:
            raise SystemExit(f"rankscope-train: --stages {stages} must be at most {len(cuts)} (the model's linear "
                             f"layers) and divide the world size {world}")
        self.stages, self.replicas = stages, world // stages
        self.stage, self.replica = divmod(rank, self.replicas)
        bounds = cuts[:stages] + [len(model)]
        self.module = model[bounds[self.stage]:bounds[self.stage + 1]]
        self.in_features = self.module[0].in_features
        self.prev = rank - self.replicas if self.stage > 0 else None
        self.next = rank + self.replicas if self.stage < stages - 1 else None
        self.last = self.next is None
        # Every rank creates every group, in the same order (torch's rule for new_group).
        groups = [dist.new_group(list(range(s * self.replicas, (s + 1) * self.replicas))) for s in range(stages)]
        self.dp_group = groups[self.stage]

    def parameters(self):
        return self.module.parameters()


def evaluate(model: nn.Module, data: TeacherDataset, device, monitor: Monitor) -> tuple[float, float]:
    if isinstance(model, PipelineStageModel):
        return evaluate_pipeline(model, data, device, monitor)
    model.eval()
    with torch.no_grad():
        logits = model(data.x.to(device))
        loss = nn.functional.cross_entropy(logits, data.y.to(device), reduction="sum")
        correct = (logits.argmax(dim=1) == data.y.to(device)).sum().float()
        totals = torch.stack([loss, correct, torch.tensor(float(len(data)), device=device)])
        with monitor.collective("all_reduce", totals):
            dist.all_reduce(totals)
    model.train()
    loss_sum, correct_sum, n = totals.tolist()
    return loss_sum / n, correct_sum / n


def evaluate_pipeline(stage: PipelineStageModel, data: TeacherDataset, device, monitor: Monitor) -> tuple[float, float]:
    """The held-out set through the stages of replica 0, its last stage's figures sent to every rank."""
    totals = torch.zeros(3, device=device)
    if stage.replica == 0:
        with torch.no_grad():
            x = data.x.to(device)
            if stage.prev is not None:
                x = torch.empty(len(data), stage.in_features, device=device)
                with monitor.collective("recv", x):
                    dist.recv(x, stage.prev)
            out = stage.module(x)
            if stage.next is not None:
                with monitor.collective("send", out):
                    dist.send(out.contiguous(), stage.next)
            else:
                loss = nn.functional.cross_entropy(out, data.y.to(device), reduction="sum")
                correct = (out.argmax(dim=1) == data.y.to(device)).sum().float()
                totals = torch.stack([loss, correct, torch.tensor(float(len(data)), device=device)])
    with monitor.collective("broadcast", totals):
        dist.broadcast(totals, src=dist.get_world_size() - stage.replicas)   # replica 0's last stage
    loss_sum, correct_sum, n = totals.tolist()
    return loss_sum / n, correct_sum / n


def model_flops(hidden: int) -> FlopsConfig:
    """What the RANKSCOPE_ FLOPs variables say, else the reference model's own figure: each
    parameter is one multiply-add per sample forward and two backward, 6 FLOPs in all."""
    flops = FlopsConfig.from_env()
    if flops.counts_flops:
        return flops
    params = sum(p.numel() for p in build_model(hidden).parameters())
    return FlopsConfig.from_env(flops_per_sample=6 * params)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        # Ranks share the cores; more threads per rank only fight each other.
        # OMP_NUM_THREADS, when set (torchrun sets 1 for several ranks per node), wins.
        share = (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS") or share)))
    backend = "nccl" if cuda else "gloo"
    layout = None
    if args.parallelism == "pipeline":   # the stage this rank will hold (PipelineStageModel)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        layout = f"pp={int(os.environ.get('RANK', '0')) // max(world // args.stages, 1)}"
    try:
        monitor = Monitor(device=device, backend=backend, run=args.run_id, metrics_port=args.metrics_port,
                          flops=model_flops(args.hidden), layout=layout)
    except ConfigError as e:
        print(f"rankscope-train: error: {e}", file=sys.stderr)
        return 2
    start_up = StartUpFaults(args)
    start_up.before_init()
    dist.init_process_group(start_up.backend(backend), timeout=datetime.timedelta(minutes=10))
    start_up.after_init()
    torch.manual_seed(args.seed)
    if dist.get_rank() == 0:
        cfg = monitor.config
        print(f"rankscope: run {monitor.identity.run!r}, {dist.get_world_size()} ranks ({backend}); "
              f"live metrics at http://{cfg.metrics_addr}:{cfg.metrics_port}/metrics", flush=True)
    train(args, monitor, device)
    dist.barrier()
    monitor.close()
    dist.destroy_process_group()
    return 0


class StartUpFaults:
    """The start-up faults of this rank, known from the launcher's environment (no process group yet)."""

    def __init__(self, args: argparse.Namespace):
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        fault_rank = world - 1 if args.fault_rank is None else args.fault_rank
        self.on = args.all_ranks or rank == fault_rank
        self.args = args

    def before_init(self) -> None:
        if self.on and self.args.late_init:
            time.sleep(self.args.late_init)

    def backend(self, backend: str) -> str:
        # A misspelt backend in one rank's configuration: torch raises inside init_process_group.
        return f"cpu:{backend}x" if self.on and self.args.init_error else backend

    def after_init(self) -> None:
        if self.on and self.args.late_first_step:
            time.sleep(self.args.late_first_step)


class Faults:
    """The faults this rank injects (all off unless it is a fault rank), and the noise of a healthy run."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int):
        fault_rank = world - 1 if args.fault_rank is None else args.fault_rank
        self.on = args.all_ranks or rank == fault_rank
        self.rank = rank
        self.args = args
        self.leaked: list[bytearray] = []
        self.noise = random.Random(args.seed * 1000 + rank)

    def at(self, what: str, step: int) -> bool:
        return self.on and getattr(self.args, what) == step

    def before_forward(self, step: int, work: bool = True) -> None:
        a = self.args
        if self.at("oom_at", step):
            raise torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 80.00 GiB")
        if self.at("crash_at", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.at("raise_at", step):
            raise ValueError(f"injected: corrupt sample in batch of step {step}")
        if self.at("device_error_at", step):   # what a faulty GPU's kernel leaves for the next synchronising call
            raise torch.AcceleratorError("injected: CUDA error: an illegal memory access was encountered\n"
                                         "CUDA kernel errors might be asynchronously reported at some other API call")
        if self.on and a.slow_rank_delay:
            time.sleep(a.slow_rank_delay)
        if self.on and a.leak_mb_per_step and step >= a.leak_from and len(self.leaked) * a.leak_mb_per_step < a.leak_max_mb:
            self.leaked.append(bytearray(int(a.leak_mb_per_step * 2**20)))   # zero-filled: resident at once
        if work:
            time.sleep(self.work(a.step_delay))

    def work(self, seconds: float) -> float:
        """``seconds`` of simulated compute as this rank's batch makes it: +-jitter, or with
        --uneven-work a length of 0.2-1.0 of the longest (mean 1x), drawn afresh each time."""
        a = self.args
        if not seconds:
            return 0.0
        if a.uneven_work:
            return seconds * self.noise.uniform(0.2, 1.0) / 0.6
        return seconds * self.noise.uniform(1 - a.jitter, 1 + a.jitter)

    def loss(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        a = self.args
        if a.loss_noise:
            loss = loss * self.noise.uniform(1 - a.loss_noise, 1 + a.loss_noise)
        if self.at("nan_loss_at", step):
            return loss * float("nan")
        if self.at("loss_spike_at", step):
            return loss * 50.0
        spikes_from = a.loss_spikes_from
        if self.on and spikes_from is not None and 0 <= step - spikes_from < 50 and (step - spikes_from) % 10 == 0:
            return loss * 50.0
        if self.on and a.diverge_from is not None and step >= a.diverge_from:
            return loss * (1.0 + 0.01 * (step - a.diverge_from))
        return loss

    def sync_skipped(self, model: nn.Module, step: int) -> Any:
        """The context STEP's forward and backward run in: DDP's no_sync() on the fault rank at --no-sync-at."""
        if self.at("no_sync_at", step) and isinstance(model, DDP):
            print(f"rank {self.rank}: injected no_sync() at step {step}", flush=True)
            return model.no_sync()
        return contextlib.nullcontext()

    def after_optimizer(self, model: nn.Module, step: int) -> None:
        if self.at("flip_bit_at", step):
            weight = dict(_module(model).named_parameters())["2.weight"]
            with torch.no_grad():
                _local(weight).view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 20)
            print(f"rank {self.rank}: injected a bit flip in 2.weight after step {step}", flush=True)

    def perturb(self, model: nn.Module) -> None:
        if self.on and self.args.resume_perturbed:
            with torch.no_grad():
                for p in _module(model).parameters():
                    _local(p).add_(self.args.resume_perturbed)
            print(f"rank {self.rank}: starts {self.args.resume_perturbed} off the others' weights", flush=True)

    def before_backward(self, step: int) -> None:
        if self.at("hang_at", step):
            print(f"rank {self.rank}: injected hang at step {step}", flush=True)
            while True:  # peers block in this step's all-reduce
                time.sleep(1)


def _module(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DDP) else model


def _local(t: torch.Tensor) -> torch.Tensor:
    """A parameter's own bits on this rank (a DTensor's local shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


def train(args: argparse.Namespace, monitor: Monitor, device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    faults = Faults(args, rank, world)
    train_set = TeacherDataset(args.samples, args.seed, "train", slow_delay=args.slow_data_delay if faults.on else 0.0)
    eval_set = TeacherDataset(4096, args.seed, "eval")
    model, data_rank, data_world = parallelize(args, monitor, device)
    faults.perturb(model)
    sampler = DistributedSampler(train_set, num_replicas=data_world, rank=data_rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        collate_fn=train_set.collate, drop_last=True, persistent_workers=args.workers > 0)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=2)
    accuracy = monitor.gauge("eval_accuracy_ratio", "Accuracy of the reference model on the held-out set.")
    eval_loss_metric = monitor.gauge("eval_loss", "Loss of the reference model on the held-out set.")
    loss_fn = nn.CrossEntropyLoss()
    step = 0
    if args.resume:
        with monitor.checkpoint("restore"):
            step = load_checkpoint(args.checkpoint_dir, model, opt)
    epoch, first, t_start = 0, step, time.perf_counter()
    comm_debug = CommCounts() if args.comm_debug else None
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in monitor.data(loader):
            if step >= args.steps:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with comm_debug.count("step") if comm_debug else contextlib.nullcontext():
                loss = train_step(monitor, model, opt, loss_fn, x, y, step, faults)
            step += 1
            if step % args.eval_every == 0 or step == args.steps:
                with monitor.evaluation(), comm_debug.count("eval") if comm_debug else contextlib.nullcontext():
                    eval_loss, acc = evaluate(model, eval_set, device, monitor)
                    time.sleep(args.eval_pause)
                sched.step(eval_loss)
                accuracy.set(acc)
                eval_loss_metric.set(eval_loss)
                if rank == 0:
                    print(f"step {step}: eval loss {eval_loss:.4f} accuracy {acc:.3f}", flush=True)
            if args.checkpoint_every and step % args.checkpoint_every == 0 and args.save_on_rank0_only:
                if rank == 0:
                    with monitor.checkpoint("save"):
                        save_checkpoint(args.checkpoint_dir, step, model, opt, args.checkpoint_pause, barrier=False)
                dist.barrier()   # the other ranks wait here, in no block of their own
            elif args.checkpoint_every and step % args.checkpoint_every == 0:
                with monitor.checkpoint("save"):
                    save_checkpoint(args.checkpoint_dir, step, model, opt, args.checkpoint_pause)
            if rank == 0 and step % args.print_every == 0:
                print(f"step {step}/{args.steps} loss {loss.item():.4f} lr {opt.param_groups[0]['lr']:.4g} "
                      f"{1000 * (time.perf_counter() - t_start) / (step - first):.1f} ms/step", flush=True)
        epoch += 1
    if comm_debug and rank == 0:
        print("comm-debug: " + json.dumps(comm_debug.totals, sort_keys=True), flush=True)


class CommCounts:
    """Collectives counted by torch's own CommDebugMode, per kind of work (step, eval) and op."""

    def __init__(self) -> None:
        self.totals: dict[str, dict[str, int]] = {}

    @contextlib.contextmanager
    def count(self, what: str):
        from torch.distributed.tensor.debug import CommDebugMode

        mode = CommDebugMode()
        with mode:
            yield
        totals = self.totals.setdefault(what, {"times": 0})
        totals["times"] += 1
        for op, n in mode.get_comm_counts().items():
            name = str(op).split(".")[-1]   # c10d._allgather_base_, c10d_functional.all_reduce -> the op's name
            totals[name] = totals.get(name, 0) + n


def save_checkpoint(directory: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer,
                    pause_s: float, barrier: bool = True) -> None:
    """Rank 0 saves the step, the model and the optimizer; every rank that calls it spends
    ``pause_s`` on it, as ranks wait for a real checkpoint of a large model, then (``barrier``)
    waits for the others."""
    if not isinstance(model, DDP):   # sharded (fsdp2, 2d): every rank writes its shards
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, opt_state = get_state_dict(model, opt)
        dcp.save({"model": model_state, "opt": opt_state}, checkpoint_id=directory / "sharded")
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / "checkpoint.tmp"
        state = {"step": step, "model": model.state_dict(), "opt": opt.state_dict()} if isinstance(model, DDP) \
            else {"step": step}
        torch.save(state, tmp)
        os.replace(tmp, directory / "checkpoint.pt")
    time.sleep(pause_s)
    if barrier:
        dist.barrier()


def load_checkpoint(directory: Path, model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """The step to resume from, with the model and optimizer as they were then (0: none saved)."""
    path = directory / "checkpoint.pt"
    if not path.exists():
        return 0
    state = torch.load(path, map_location="cpu")
    if isinstance(model, DDP):
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, opt_state = get_state_dict(model, opt)
        sharded = {"model": model_state, "opt": opt_state}
        dcp.load(sharded, checkpoint_id=directory / "sharded")
        set_state_dict(model, opt, model_state_dict=sharded["model"], optim_state_dict=sharded["opt"])
    return int(state["step"])


def train_step(monitor: Monitor, model: nn.Module, opt: torch.optim.Optimizer, loss_fn: nn.Module,
               x: torch.Tensor, y: torch.Tensor, step: int, faults: Faults) -> torch.Tensor:
    if isinstance(model, PipelineStageModel):
        return pipeline_step(monitor, model, opt, loss_fn, x, y, step, faults)
    with monitor.step(samples=len(x), step=step) as s, faults.sync_skipped(model, step):
        with s.phase("forward"):
            faults.before_forward(step)
            loss = faults.loss(loss_fn(model(x), y), step)
        faults.before_backward(step)
        with s.phase("backward"):
            loss.backward()
        with s.phase("optimizer"):
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=5.0)
            if hasattr(grad_norm, "full_tensor"):   # a DTensor (fsdp2, hsdp, 2d)
                grad_norm = grad_norm.full_tensor()
            opt.step()
            opt.zero_grad(set_to_none=True)
            faults.after_optimizer(model, step)
        s.observe(loss=loss, grad_norm=grad_norm, lr=opt.param_groups[0]["lr"])
    return loss



def pipeline_step(monitor: Monitor, stage: PipelineStageModel, opt: torch.optim.Optimizer, loss_fn: nn.Module,
                  x: torch.Tensor, y: torch.Tensor, step: int, faults: Faults) -> torch.Tensor:
    """One step of a GPipe schedule: every micro-batch forward, then every one backward, then the
    stage's data-parallel gradient all-reduce. The waits for the neighbouring stages and for the
    stage's peers are the ``comm_wait`` phase, so that each stage's compute is its own.
    --step-delay x the stage's --stage-cost is its simulated compute per step, a third forward."""
    args = faults.args
    stage_seconds = args.step_delay * args.stage_cost[stage.stage] / args.micro_batches
    inputs, outputs, sends = [], [], []
    loss_total = torch.zeros((), device=x.device)
    with monitor.step(samples=len(x), step=step) as s:
        with s.phase("forward"):
            faults.before_forward(step, work=False)
        for xb in x.chunk(args.micro_batches):
            if stage.prev is not None:
                xb = torch.empty(len(xb), stage.in_features, device=x.device)
                with s.phase("comm_wait"), monitor.collective("recv", xb):
                    dist.recv(xb, stage.prev)
                xb.requires_grad_(True)
            with s.phase("forward"):
                work = faults.work(stage_seconds)
                time.sleep(work / 3)
                out = stage.module(xb)
            inputs.append((xb, work))
            outputs.append(out)
            if stage.next is not None:
                sends.append(dist.isend(out.detach().contiguous(), stage.next))
        faults.before_backward(step)
        for (xb, work), out, yb in reversed(list(zip(inputs, outputs, y.chunk(args.micro_batches)))):
            if stage.last:
                with s.phase("forward"):
                    loss = faults.loss(loss_fn(out, yb), step) / args.micro_batches
                loss_total += loss.detach()
                grad = None
            else:
                grad = torch.empty_like(out)
                with s.phase("comm_wait"), monitor.collective("recv", grad):
                    dist.recv(grad, stage.next)
            with s.phase("backward"):
                time.sleep(2 * work / 3)
                (loss if grad is None else out).backward(grad)
            if stage.prev is not None:
                sends.append(dist.isend(xb.grad.contiguous(), stage.prev))
        with s.phase("comm_wait"):
            for work_handle in sends:
                work_handle.wait()
            grads = [p.grad for p in stage.module.parameters()]
            if stage.replicas > 1:
                flat = torch.cat([g.reshape(-1) for g in grads])
                with monitor.collective("all_reduce", flat):
                    dist.all_reduce(flat, group=stage.dp_group)
                flat /= stage.replicas
                offset = 0
                for g in grads:
                    g.copy_(flat[offset:offset + g.numel()].view_as(g))
                    offset += g.numel()
        with s.phase("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        s.observe(loss=loss_total if stage.last else None, lr=opt.param_groups[0]["lr"])
    return loss_total


if __name__ == "__main__":
    raise SystemExit(main())
