"""The process groups one rank publishes: each labelled once, bound to its series, published.

Group labels: ``group`` is the role, ``default`` for the default group, the
device-mesh dimension name for a mesh's groups (DeviceMesh names them
``mesh_<dim>``; one over the whole world reuses the default group, and is named by
its dimension once ``watch()`` saw the mesh: ``roles``), the group's own description where the user gave one, else
``pg<name>``; ``group_id`` is the group's name, which torch makes the same on
every member rank. A group with both a CUDA and a CPU backend
(``"cuda:nccl,cpu:gloo"``) numbers its collectives per backend: its CPU
backend's half is ``group_id="<name>.cpu"``, so that the two sequences are never
compared with each other. At most ``max_groups`` groups per rank are published; the
collectives of any further group are counted as dropped (``process_group``).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from rankscope.collectives.protocols import Counting, ProcessGroupSink

log = logging.getLogger("rankscope")

MAX_LABEL = 32               # characters of a group label taken from a description


def group_label(name: str, desc: str) -> str:
    """The bounded, readable role of a group (see the module docstring)."""
    if desc == "default_pg" or name == "0" and desc in ("", "undefined"):
        return "default"
    role = desc[len("mesh_"):] if desc.startswith("mesh_") else desc
    if role in ("", "undefined", "default"):
        return "pg" + re.sub(r"[^a-z0-9_]", "_", name.lower())[:MAX_LABEL]
    return re.sub(r"[^a-z0-9_]", "_", role.lower())[:MAX_LABEL]


@dataclass
class Group:
    """One process group of one recorder. ``enqueued`` and ``completed`` are the published
    sequence numbers of its collectives: the status's, or, once the status is seen counting
    other work too (``counts_p2p``), the entries'."""

    pg_id: str
    name: str
    label: str
    size: int = 0                                      # ranks in the group (0: unknown, no bus bytes)
    series: dict = field(default_factory=dict)         # op -> (count child, bytes child, bus bytes child)
    in_flight: dict = field(default_factory=dict)      # seq -> (op, unix seconds enqueued)
    published_in_flight: dict = field(default_factory=dict)   # op -> start last written
    enqueued: int = -1
    completed: int = -1
    seq_children: tuple = ()
    # The status numbers every op of the group (gloo: send and recv too; NCCL: its p2p work by
    # its own counter), while the entries' collective_seq_id numbers only its collectives: in a
    # pipeline group the stages' status numbers differ by their sends and receives. Once the
    # status is ahead of the entries' newest collective, the entries' numbers are published.
    status_enqueued: int = -1
    collective_enqueued: int = -1     # the newest collective's seq among the entries read
    collective_completed: int = -1    # the newest retired (completed) one's
    counts_p2p: bool = False
    placeholder: bool = False         # the default group at 0, before the rank's first collective


class GroupTable:
    """The groups of every recorder, by (recorder, pg_id), at most ``max_groups`` of them; each
    labelled (its mesh dimension where ``roles`` names it, else its role) and bound to its
    series (``metrics``: ProcessGroupSink) on first sight, and published by ``publish()``.

    ``recorders``: the recorders read; where NCCL's is one of them, the CPU recorder's half of a
    group that also has a CUDA backend is a group of its own (``<name>.cpu``)."""

    def __init__(self, metrics: ProcessGroupSink, max_groups: int, recorders: Sequence[str]):
        self._m = metrics
        self.max_groups = max_groups
        self._reads_nccl = "nccl" in recorders
        self.groups: dict[tuple[str, str], Group] = {}   # (recorder, pg_id) -> Group
        # Group name -> its device-mesh dimension, where the monitor learnt the job's mesh
        # (rankscope.layout.group_roles): a dimension over the whole world reuses the default group.
        self.roles: dict[str, str] = {}
        self._refused: set[tuple[str, str]] = set()      # groups over the budget

    def knows(self, key: tuple[str, str]) -> bool:
        """Whether the group (recorder, pg_id) has its labels, or was refused (over the budget)."""
        return key in self.groups or key in self._refused

    def note_status(self, recorder: str, status: dict[str, dict[str, str]], suspect: dict[str, int]) -> bool:
        """Store each known group's sequence numbers; True when a collective stayed in flight
        since the last read and its op is not known yet (``suspect``: the recorder's pg_id -> seq
        seen in flight at its last status read, updated here)."""
        stuck = False
        for pg_id, s in status.items():
            enqueued = int(s.get("last_enqueued_collective", -1))
            completed = int(s.get("last_completed_collective", -1))
            group = self.groups.get((recorder, pg_id))
            if group is not None:
                group.status_enqueued = enqueued
                if not group.counts_p2p:
                    group.enqueued, group.completed = enqueued, completed
            waiting = completed + 1 if completed < enqueued else None
            if waiting is not None and suspect.get(pg_id) == waiting \
                    and (group is None or waiting not in group.in_flight):
                stuck = True
            if waiting is None:
                suspect.pop(pg_id, None)
            else:
                suspect[pg_id] = waiting
        return stuck

    def group(self, recorder: str, pg_id: str, process_group: Sequence[object],
              status: dict[str, dict[str, str]]) -> Group | None:
        """The group of an entry (``process_group``: its [name, description]), made on first
        sight with the sequence numbers of the recorder's last ``status``; None over the budget."""
        key = (recorder, pg_id)
        group = self.groups.get(key)
        if group is not None and not group.placeholder or key in self._refused:
            return group
        if group is not None:   # the placeholder meets the group's first entries: the group proper
            del self.groups[key]
            if self.label(process_group) == group.label:
                group.placeholder = False
                self.groups[key] = group
                return group
            # Named by its mesh dimension since (watch()): the placeholder's series are retired
            # (NaN: no comparison holds), the group's own are bound under its name.
            for child in group.seq_children:
                child.set(math.nan)
        if len(self.groups) >= self.max_groups:
            self._refused.add(key)
            log.warning("rankscope: more than %d process groups on this rank; collectives of group %s are "
                        "dropped (RANKSCOPE_MAX_PROCESS_GROUPS)", self.max_groups, process_group)
            return None
        group_id = str(list(process_group)[0])
        if recorder == "cpu" and self._reads_nccl and _has_cuda_backend(group_id):
            group_id += ".cpu"   # the CPU half of a "cuda:nccl,cpu:gloo" group: its own sequence
        group = Group(pg_id, group_id, self.label(process_group), size=_group_size(str(list(process_group)[0])))
        group.seq_children = self._m.process_group_seq(group.label, group.name)
        group_status = status.get(pg_id, {})
        group.enqueued = group.status_enqueued = int(group_status.get("last_enqueued_collective", -1))
        group.completed = int(group_status.get("last_completed_collective", -1))
        self.groups[key] = group
        return group

    def label(self, process_group: Sequence[object]) -> str:
        """The group's label: its mesh dimension where watch() learnt it, else its role."""
        name, desc = (str(part) for part in (list(process_group) + ["", ""])[:2])
        label = self.roles.get(name) or group_label(name, desc)
        return re.sub(r"[^a-z0-9_]", "_", label.lower())[:MAX_LABEL]

    def series(self, group: Group, op: str) -> tuple[Counting, Counting, Counting]:
        series = group.series.get(op)
        if series is None:
            series = group.series[op] = self._m.process_group_counters(group.label, group.name, op)
        return series

    def use_collective_numbers(self, recorder: str) -> None:
        """After a read of the recorder's entries: a group whose status is ahead of its newest
        collective counts its sends and receives too (collectives enqueued after the status read
        can only put the entries ahead); from then on its entries' numbers are published."""
        for (group_recorder, _), group in self.groups.items():
            if group_recorder != recorder:
                continue
            if not group.counts_p2p and group.collective_enqueued >= 0 \
                    and group.status_enqueued > group.collective_enqueued:
                group.counts_p2p = True
            if group.counts_p2p:
                group.enqueued, group.completed = group.collective_enqueued, group.collective_completed

    def publish(self) -> float:
        """Writes every group's sequence numbers and in-flight starts; returns the oldest enqueue
        time still in flight in any group (0.0: none)."""
        oldest_any = 0.0
        for group in self.groups.values():
            enqueued_child, completed_child = group.seq_children
            if group.enqueued >= 0:
                enqueued_child.set(group.enqueued)
                completed_child.set(group.completed)
            for seq in [s for s in group.in_flight if s <= group.completed]:
                del group.in_flight[seq]
            oldest: dict[str, float] = {}
            for op, started in group.in_flight.values():
                if op not in oldest or started < oldest[op]:
                    oldest[op] = started
                if started and (not oldest_any or started < oldest_any):
                    oldest_any = started
            for op in set(oldest) | set(group.published_in_flight):
                since = oldest.get(op, 0.0)
                if group.published_in_flight.get(op) != since:
                    self._m.process_group_in_flight(group.label, group.name, op).set(since)
                    if since:
                        group.published_in_flight[op] = since
                    else:
                        group.published_in_flight.pop(op, None)
        return oldest_any


def _has_cuda_backend(group_name: str) -> bool:
    """Whether the process group called ``group_name`` also has a CUDA backend."""
    from torch.distributed import distributed_c10d

    for pg, name in list(distributed_c10d._world.pg_names.items()):
        if name == group_name:
            return any(getattr(t, "type", t) == "cuda" for t in getattr(pg, "_device_types", ()))
    return False


def _group_size(group_name: str) -> int:
    """The size of the process group called ``group_name`` (0 if this process has none by that name)."""
    from torch.distributed import distributed_c10d

    for pg, name in list(distributed_c10d._world.pg_names.items()):
        if name == group_name:
            try:
                return int(pg.size())
            except Exception:   # a group being destroyed: its bus bytes are not counted
                return 0
    return 0
