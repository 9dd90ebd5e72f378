"""rankscope must never change what a job trains to: the same weights, bit for bit.

    torchrun --nproc-per-node 4 same_weights.py SCENARIO [SCENARIO ...] [--steps N]

Each SCENARIO trains two copies of one model side by side, from the same seed on
the same batches: one as the user's code alone would (``bare``), one under
``monitor.watch()`` with the comm timing given (``watched``). After every step the
two copies' gradients and, at the end, their weights are compared with
``torch.equal``. Each scenario has its own Monitor (run "<RANKSCOPE_RUN>-<SCENARIO>"),
closed before the next one opens. Writes $LOOP_OUT/<SCENARIO>/rank<N>.json:
``{"equal_grads": bool, "equal_weights": bool, "max_diff": float, "strategy": str,
"steps": int, "timed_all_reduces": float}`` (the all-reduces rankscope timed).

SCENARIO (4 ranks)
  subgroup        two DDP replicas, over the sub-groups {0,1} and {2,3} (process_group=)
  odd_group       DDP over a group of three ranks {0,1,2} (rank 3 alone): a group size
                  whose reciprocal is not exact in binary
  mesh_dim        a 2-D device mesh ("dp", "tp"), DDP over its "dp" dim (device_mesh=)
  world           DDP over the whole world
  hook_before     the user's own comm hook (bf16 compression) registered before watch()
  hook_after      the user's own comm hook registered after watch()
  fp16_after      torch's fp16_compress_hook registered after watch()
  view_pair       as subgroup, with gradient_as_bucket_view=True (DDP divides in place from step 2)
  view_odd        as odd_group, with gradient_as_bucket_view=True
  view_world      as world, with gradient_as_bucket_view=True

``--device cuda``: the models and batches on the rank's GPU (cuda:<LOCAL_RANK % GPUs>; the
GPU check runs two ranks on one GPU over gloo with CUDA tensors: the hook's arithmetic on
the device, its buckets timed by CUDA events).
  fsdp1           an FSDP1 (FullyShardedDataParallel) model under watch()
  fsdp2           fully_shard over the world (nothing replicated: no replica check)
  hsdp            fully_shard over a 2 x 2 mesh (dp_replicate, dp_shard): its shards checked across replicas
  tp              tensor parallel over the world (a row-parallel bias replicated: checked across the group)

Every scenario runs with the replica check at every step (RANKSCOPE_REPLICA_CHECK_EVERY, set by the
test): the fingerprints it takes read the weights and gradients, never change them.

RANKSCOPE_COMM_TIMING picks the strategy for every scenario (default: hook).
"""

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from rankscope import Monitor

SCENARIOS = ("subgroup", "odd_group", "mesh_dim", "world", "hook_before", "hook_after", "fp16_after", "view_pair",
             "view_odd", "view_world", "fsdp1", "fsdp2", "hsdp", "tp")
DEVICE = torch.device("cpu")


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)).to(DEVICE)


def batches(steps: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + rank)   # each rank its own data, as in data parallelism
    return [(torch.randn(16, 32, generator=g).to(DEVICE), torch.randn(16, 8, generator=g).to(DEVICE))
            for _ in range(steps)]


def bf16_hook(state, bucket):
    """A user's compression hook (torch's own bf16_compress_hook, group from the state)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    return bf16_compress_hook(state, bucket)


def wrap(scenario: str, model: nn.Module, rank: int):
    """The scenario's parallel wrapper, built the same way for both copies."""
    world = dist.get_world_size()
    view = scenario.startswith("view_")
    if scenario in ("subgroup", "view_pair"):
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        return DDP(model, process_group=groups[rank // 2], bucket_cap_mb=0.01, gradient_as_bucket_view=view)
    if scenario in ("odd_group", "view_odd"):
        groups = [dist.new_group([0, 1, 2]), dist.new_group([3])]
        return DDP(model, process_group=groups[0 if rank < 3 else 1], bucket_cap_mb=0.01,
                   gradient_as_bucket_view=view)
    if scenario == "mesh_dim":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        return DDP(model, device_mesh=mesh["dp"], bucket_cap_mb=0.01)
    if scenario in ("world", "hook_before", "hook_after", "fp16_after", "view_world"):
        ddp = DDP(model, bucket_cap_mb=0.01, gradient_as_bucket_view=view)
        if scenario == "hook_before":
            ddp.register_comm_hook(ddp.process_group, bf16_hook)
        return ddp
    if scenario == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
    if scenario in ("fsdp2", "hsdp", "tp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if scenario == "tp":
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
            return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        shape, names = ((world,), ("dp_shard",)) if scenario == "fsdp2" else ((2, world // 2), ("dp_replicate", "dp_shard"))
        return fully_shard(model, mesh=init_device_mesh("cpu", shape, mesh_dim_names=names))
    raise SystemExit(f"unknown scenario {scenario!r}")


def local(t: torch.Tensor) -> torch.Tensor:
    """The bits this rank holds (a DTensor's local shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


def run(scenario: str, steps: int, rank: int) -> dict:
    data = batches(steps, rank)
    bare = wrap(scenario, make_model(), rank)
    watched = wrap(scenario, make_model(), rank)
    monitor = Monitor(run=f"{os.environ['RANKSCOPE_RUN']}-{scenario}", device=DEVICE,
                      comm_timing=os.environ.get("RANKSCOPE_COMM_TIMING", "hook"))
    try:
        watched = monitor.watch(watched)
        if scenario in ("hook_after", "fp16_after"):
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

            for ddp in (bare, watched):
                ddp.register_comm_hook(ddp.process_group, bf16_hook if scenario == "hook_after" else fp16_compress_hook)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (bare, watched)]
        equal_grads = True
        for x, y in data:
            for model, opt in zip((bare, watched), opts):
                if model is watched:
                    with monitor.step(samples=len(x)) as step:
                        loss = nn.functional.mse_loss(model(x), y)
                        with step.phase("backward"):
                            loss.backward()
                        step.observe(loss=loss)
                else:
                    nn.functional.mse_loss(model(x), y).backward()
            # (FSDP1 leaves the gradient of a parameter this rank holds no shard of as None)
            grads = [[None if p.grad is None else local(p.grad).clone() for p in m.parameters()] for m in (bare, watched)]
            equal_grads &= all(a is b is None or a is not None and b is not None and torch.equal(a, b)
                               for a, b in zip(*grads))
            for opt in opts:
                opt.step()
                # With gradient_as_bucket_view, gradients kept (not set to None) stay views of DDP's
                # buckets, which DDP then divides in place: the path whose last bits could differ.
                opt.zero_grad(set_to_none=not scenario.startswith("view_"))
        pairs = [(local(a), local(b)) for a, b in zip(bare.parameters(), watched.parameters())]
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()   # the test's own wait: the buckets' events are then complete
        monitor.parts.publisher.flush()
        timed = sum(b.get() for b in monitor.parts.metrics.collective("all_reduce").duration._buckets)
        check = monitor.parts.watched.replica_check
        published = [x for m in monitor.parts.metrics.family("rankscope_replica_fingerprint").collect()
                     for x in m.samples if x.labels["part"] == "all"]
        return {"equal_grads": equal_grads, "timed_all_reduces": timed,
                "replica_sets": [] if check is None else [s.labels for s in check._sets],
                "replica_fingerprints": sorted({x.labels["of"] for x in published}),
                "equal_weights": all(torch.equal(a, b) for a, b in pairs),
                "max_diff": max(float((a - b).abs().max()) if a.numel() else 0.0 for a, b in pairs),
                "strategy": monitor.parts.watched.comm.mode, "steps": steps}
    finally:
        monitor.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenarios", nargs="+", choices=SCENARIOS)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    if args.device == "cuda":
        global DEVICE
        DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(DEVICE)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        for scenario in args.scenarios:
            result = run(scenario, args.steps, rank)
            out = Path(os.environ["LOOP_OUT"]) / scenario
            out.mkdir(parents=True, exist_ok=True)
            (out / f"rank{rank}.json").write_text(json.dumps(result))
            print(f"rank {rank} {scenario}: {result}", flush=True)
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
