"""Which tensors of a model must be bit-identical on other ranks, and on which ranks.

A replica set is a list of local tensors that every rank of one process group holds in the
same bits after each optimizer step, learnt from how the model is parallelised:

* a DistributedDataParallel model: all of its parameters, over DDP's process group
  (``replicas="ddp"``);
* DTensor parameters (FSDP2 ``fully_shard``, HSDP, tensor parallel): the parameters placed
  ``Replicate()`` on a mesh dimension, over that dimension's process group; the local shard
  is compared, so an HSDP model is compared shard by shard along its replicate dimension
  (``replicas="dp_replicate"``, ``shard="dp_shard=1"``) and a tensor-parallel model's
  replicated parameters (a row-parallel bias) across its ``tp`` group.

Anything else (a plain module, FSDP1's flat parameters, a model replicated by code
rankscope cannot see) has no replica set: nothing is compared and nothing costs.

``group`` is the process group's name, the same on each of its ranks and different for two
groups of one dimension: the rules compare the ranks of one group. ``shard`` is for people:
which part of the model the group's copies are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# The integer type whose bits each floating type is summed as (rankscope.replicas.check).
BITS_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class ReplicaSet:
    replicas: str                    # "ddp", or the mesh dimension the tensors are replicated on
    group: str                       # the process group's name (the same on each member)
    shard: str                       # which part of the model ("dp_shard=1"); "" for all of it
    size: int                        # ranks holding a copy
    names: tuple[str, ...]           # the parameters' names, in the model's order
    parameters: tuple[Any, ...]      # the parameters (their .grad is the gradient compared)

    @property
    def labels(self) -> dict[str, str]:
        return {"replicas": self.replicas, "group": self.group, "shard": self.shard}


def local(tensor: torch.Tensor) -> Any:
    """The rank's own part of a parameter or gradient (a DTensor's local shard)."""
    to_local = getattr(tensor, "to_local", None)
    return (to_local() if to_local is not None else tensor).detach()


def signature(model: torch.nn.Module) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The model's parameters by name and local shape: what must not change for the sets to hold."""
    return tuple((name, tuple(local(p).shape)) for name, p in _named_parameters(model))


def find(model: torch.nn.Module) -> list[ReplicaSet]:
    """The replica sets of ``model`` (what ``Monitor.watch()`` was given); [] for none."""
    from rankscope.collectives.comm_timing import is_ddp

    if is_ddp(model):
        group = model.process_group
        named = [(n, p) for n, p in model.module.named_parameters() if _summable(p)]
        if group.size() < 2 or not named:
            return []
        return [ReplicaSet("ddp", str(group.group_name), _ddp_shard(named), group.size(),
                           tuple(n for n, _ in named), tuple(p for _, p in named))]
    by_key: dict[tuple[str, str, str, int], list[tuple[str, Any]]] = {}
    for name, p in _named_parameters(model):
        key = _replicated_on(p)
        if key is not None and _summable(p):
            by_key.setdefault(key, []).append((name, p))
    return [ReplicaSet(dim, group, shard, size, tuple(n for n, _ in named), tuple(p for _, p in named))
            for (dim, group, shard, size), named in by_key.items()]


def _named_parameters(model: torch.nn.Module) -> list[tuple[str, Any]]:
    from rankscope.collectives.comm_timing import is_ddp

    return list((model.module if is_ddp(model) else model).named_parameters())


def _summable(p: Any) -> bool:
    return local(p).element_size() in BITS_OF_SIZE and not local(p).is_complex()


def _replicated_on(p: Any) -> tuple[str, str, str, int] | None:
    """(mesh dimension, its group's name, the other dimensions' coordinates, size) of the first
    dimension of more than one rank a DTensor parameter is replicated on; None for none."""
    placements, mesh = getattr(p, "placements", None), getattr(p, "device_mesh", None)
    if placements is None or mesh is None or not mesh.mesh_dim_names:
        return None
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    for dim, placement in enumerate(placements):
        if placement.is_replicate() and mesh.size(dim) > 1:
            names = mesh.mesh_dim_names
            shard = ",".join(f"{n}={c}" for i, (n, c) in enumerate(zip(names, coordinate)) if i != dim)
            return str(names[dim]), str(mesh.get_group(dim).group_name), shard, mesh.size(dim)
    return None


def _ddp_shard(named: list[tuple[str, Any]]) -> str:
    """A DDP over tensor-parallel DTensors replicates one tensor-parallel shard: its coordinates."""
    mesh = getattr(named[0][1], "device_mesh", None)
    coordinate = mesh.get_coordinate() if mesh is not None else None
    if not coordinate or not mesh.mesh_dim_names:
        return ""
    return ",".join(f"{n}={c}" for n, c in zip(mesh.mesh_dim_names, coordinate))
