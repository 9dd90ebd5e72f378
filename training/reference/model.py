"""The reference trainer's model and data: a student MLP learning a fixed random teacher on
synthetic data, in each parallelism the trainer offers, and its evaluation."""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset

from rankscope.flops import FlopsConfig
from rankscope.monitor import Monitor

IN_FEATURES, CLASSES = 32, 10


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
    recorder shows it their collectives (rankscope.collectives.group_reader)."""
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
