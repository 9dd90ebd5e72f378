"""What the reference trainer's fault rank does (each fault off unless asked for), the noise of a
healthy run, and the collectives torch's CommDebugMode counts."""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import time
from typing import Any

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


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
