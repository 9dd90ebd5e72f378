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
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from rankscope.config import ConfigError
from rankscope.monitor import Monitor
from rankscope.reference.faults import CommCounts, Faults, StartUpFaults
from rankscope.reference.model import PipelineStageModel, TeacherDataset, evaluate, model_flops, parallelize

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
