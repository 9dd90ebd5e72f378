"""Replicas in agreement, as the console shows them: the rules' comparison
(prometheus/rules_spec.py, "replicas") done again on one set of samples.

The ranks of one replica group (``replicas``, ``group``) that published the same check step are
compared by their weights' fingerprint (``rankscope_replica_fingerprint{part="all"}``): the
fingerprint most hold is the group's. Judged, as the rules judge it, only once a majority of
the group (``rankscope_replica_group_size``) holds one fingerprint, or every rank has checked.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable

from rankscope.contract.replicas import step_of


@dataclass
class ReplicaGroup:
    replicas: str
    group: str
    shards: list[str]
    size: int
    step: int | None = None              # the latest judged check; None: none judged yet
    agreeing: int = 0                    # ranks in the largest camp at that step
    differing: list[int] = field(default_factory=list)   # ranks outside it (a tie: every tied rank)
    tie: bool = False

    def line(self) -> str:
        where = f"{self.replicas} group {self.group}" + (f" ({', '.join(self.shards)})" if any(self.shards) else "")
        if self.step is None:
            return f"{where}: no check judged yet"
        if not self.differing:
            return f"{where}: {self.agreeing}/{self.size} agree at step {self.step}"
        ranks = ", ".join(f"rank {r}" for r in self.differing)
        if self.tie:
            return f"{where}: split at step {self.step}, {ranks} (no majority)"
        return f"{where}: {ranks} differ{'s' if len(self.differing) == 1 else ''} at step {self.step} " \
               f"({self.agreeing}/{self.size} agree)"


def replica_groups(samples: Iterable, run: str) -> list[ReplicaGroup]:
    """The run's replica groups and their latest judged check, from exporter or Prometheus samples
    (objects with ``name``, ``labels`` and ``value``)."""
    sizes: dict[tuple[str, str], int] = {}
    shards: dict[tuple[str, str], set[str]] = defaultdict(set)
    checks: dict[tuple[str, str], dict[int, dict[float, list[int]]]] = defaultdict(lambda: defaultdict(dict))
    for s in samples:
        labels = s.labels
        if labels.get("run") != run or "group" not in labels or "replicas" not in labels:
            continue
        key = (labels["replicas"], labels["group"])
        if s.name == "rankscope_replica_group_size":
            sizes[key] = int(s.value)
            shards[key].add(labels.get("shard", ""))
        elif s.name == "rankscope_replica_fingerprint" and labels.get("part") == "all" \
                and labels.get("of") == "weights":
            checks[key][step_of(s.value)].setdefault(s.value, []).append(int(labels["rank"]))
    out = []
    for key, size in sorted(sizes.items()):
        group = ReplicaGroup(key[0], key[1], sorted(shards[key]), size)
        for step in sorted(checks[key], reverse=True):
            camps = sorted(checks[key][step].values(), key=len, reverse=True)
            checked = sum(len(c) for c in camps)
            largest = len(camps[0])
            tied = [c for c in camps if len(c) == largest]
            if len(tied) > 1 and checked == size:
                group.step, group.agreeing, group.tie = step, largest, True
                group.differing = sorted(r for c in tied for r in c)
                break
            if len(tied) == 1 and largest * 2 > size:
                group.step, group.agreeing = step, largest
                group.differing = sorted(r for c in camps[1:] for r in c)
                break
        out.append(group)
    return out
