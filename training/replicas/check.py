"""The replica check: every K optimizer steps, a fingerprint of each replica set, published
for the rules to compare across ranks (no collective: the ranks never talk about it).

The fingerprint of a list of tensors is the sum of their bits read as integers (a contiguous
tensor's bytes as 64-bit words; otherwise each element's, float32 as int32, bfloat16 as int16),
in int64 arithmetic that wraps. Integer addition is
exact, so the same bits give the same sum in any order, on any device and any kernel; one
flipped bit changes it by a power of two. It is computed on the tensors' device, after the
step's optimizer step (weights) and just before it (gradients, once reduced), and read like a
loss: copied to pinned memory behind an event the publisher polls, never waited for.

Each fingerprint is published as one float (``rankscope.contract.replicas``):
``(step mod 2**27) * 2**26 + fold``, the 64-bit sum folded to 26 bits. One value holds the step and the fingerprint together, so a scrape
can never pair one check's step with another's fingerprint, and two ranks agree on a check
exactly when their values are equal. Two slots (by check number: ``step // K % 2``) keep
each rank's last two checks, so ranks a check apart still share one. The weights are
also published in up to ``PARTS`` consecutive parts of the parameter list, each labelled
with its first parameter's name: the page names the first part that differs.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

import torch

from rankscope.contract.replicas import encode
from rankscope.replicas.sets import BITS_OF_SIZE, ReplicaSet, find, local, signature

if TYPE_CHECKING:
    from rankscope.device.rank_device import RankDevice
    from rankscope.publishing.metrics import RankMetrics

log = logging.getLogger("rankscope")

PARTS = 8                       # weight fingerprints per set besides the total
MAX_READY = 64                  # checks waiting for the publisher, at most


def tensor_sums(tensors: list[torch.Tensor]) -> Any:
    """An int64 tensor, on the tensors' device: each tensor's bits summed as integers."""
    with torch.no_grad():
        return torch.stack([_bits_sum(t) for t in tensors])


def _bits_sum(t: torch.Tensor) -> Any:
    """The tensor's bytes as 64-bit words, summed (a contiguous tensor of whole, aligned words: a
    plain int64 sum, as fast as a float sum); else each element's bits, summed in int64 (a cast
    per element, ten times slower). Replicas share their layout, so they take the same path."""
    whole_words = (t.numel() * t.element_size()) % 8 == 0 and (t.storage_offset() * t.element_size()) % 8 == 0
    if t.is_contiguous() and whole_words:
        try:
            return t.reshape(-1).view(torch.uint8).view(torch.int64).sum()
        except RuntimeError:   # a layout view() refuses: the per-element path
            pass
    return t.view(BITS_OF_SIZE[t.element_size()]).sum(dtype=torch.int64)


def parts(count: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of at most PARTS consecutive, near-equal runs of ``count`` tensors."""
    n = min(PARTS, count)
    return [(i * count // n, (i + 1) * count // n) for i in range(n)]


class ReplicaCheck:
    """The training thread takes the fingerprints (``step_ended``, ``before_optimizer_step``);
    the publisher writes them (``publish``)."""

    def __init__(self, model: torch.nn.Module, sets: list[ReplicaSet], every: int, metrics: RankMetrics, device: RankDevice,
                 drop: Callable[[str, str], None]):
        self.every = every
        self._model = model
        self._sets = sets
        self._signature = signature(model)
        self._metrics = metrics
        self._family = metrics.family("rankscope_replica_fingerprint")
        self._sizes = metrics.family("rankscope_replica_group_size")
        self._device = device
        self._drop = drop
        self._grads_taken = -1
        self._ready: deque[tuple[ReplicaSet, str, int, list[int]]] = deque()   # (set, of, step, sums)
        self._series: dict[tuple[str, ...], Any] = {}
        self._publish_sizes(sets)

    def _publish_sizes(self, sets: list[ReplicaSet]) -> None:
        for s in sets:
            self._metrics.child(self._sizes, s.labels).set(s.size)

    @classmethod
    def of(cls, model: torch.nn.Module, every: int, metrics: RankMetrics, device: RankDevice,
           drop: Callable[[str, str], None]) -> "ReplicaCheck | None":
        """The check of a watched model; None where it has no replicas (said once) or K is 0."""
        if every == 0:
            return None
        sets = find(model)
        if not sets:
            log.info("rankscope: %s has no replicated parameters (not a DDP model, no DTensor placed Replicate() "
                     "on a mesh dimension of more than one rank): replicas are not compared", type(model).__name__)
            return None
        return cls(model, sets, every, metrics, device, drop)

    # -- training thread -----------------------------------------------------------------
    def step_ended(self, number: int) -> None:
        """After a step (its optimizer step done): the weights, on a check step."""
        if number % self.every:
            return
        now = signature(self._model)
        if now != self._signature:   # all ranks change alike (a new head); the check is skipped, counted
            self._drop("replica_check", "the model's parameters were added, removed or reshaped after watch(): "
                                        "its replicas are compared again from the next check")
            self._signature, self._sets = now, find(self._model)
            self._publish_sizes(self._sets)
            return
        for s in self._sets:
            self._take(s, "weights", number, [local(p) for p in s.parameters])

    def before_optimizer_step(self, number: int) -> None:
        """The gradients, reduced, just before a check step's first optimizer step (``number`` -1:
        outside a step)."""
        if number < 0 or number % self.every or number == self._grads_taken:
            return
        self._grads_taken = number
        for s in self._sets:
            # A parameter without a gradient (frozen, unused) counts 0: the same on every replica.
            grads = [local(p.grad) for p in s.parameters if p.grad is not None]
            if grads:
                self._take(s, "grads", number, grads)

    def _take(self, s: ReplicaSet, of: str, number: int, tensors: list[torch.Tensor]) -> None:
        sums = tensor_sums(tensors)
        device = self._device
        index = device.device_of(sums)
        if index is None:   # host tensors: already computed
            self._deliver(s, of, number, sums.tolist())
            return
        if device.reads is None:
            device.bind(index)
        if device.reads is None:
            self._drop("replica_check", f"the {of} are on cuda:{index}, which the monitor cannot time")
            return
        device.reads.defer_array(f"replica {of} fingerprint", sums,
                                 lambda values: self._deliver(s, of, number, values))

    def _deliver(self, s: ReplicaSet, of: str, number: int, sums: list[int]) -> None:
        if len(self._ready) >= MAX_READY:
            self._drop("replica_check", f"more than {MAX_READY} checks waiting for the publisher")
            return
        self._ready.append((s, of, number, sums))

    # -- publisher thread ------------------------------------------------------------------
    def publish(self) -> None:
        while self._ready:
            s, of, number, sums = self._ready.popleft()
            slot = str(number // self.every % 2)
            self._gauge(s, of, "all", "", slot).set(encode(number, sum(sums)))
            if of == "weights" and len(sums) == len(s.names):
                for i, (start, stop) in enumerate(parts(len(sums))):
                    self._gauge(s, of, str(i), s.names[start], slot).set(encode(number, sum(sums[start:stop])))

    def _gauge(self, s: ReplicaSet, of: str, part: str, param: str, slot: str) -> Any:
        key = (s.replicas, s.group, s.shard, of, part, param, slot)
        gauge = self._series.get(key)
        if gauge is None:
            gauge = self._series[key] = self._metrics.child(
                self._family, {**s.labels, "of": of, "part": part, "param": param, "slot": slot})
        return gauge
