"""An explicit collective the loop times itself: ``with monitor.collective("all_reduce", t, group=g)``."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from rankscope.collectives.tracker import CollectiveTracker, check_op, group_size, tensor_nbytes


@contextmanager
def timed_collective(tracker: CollectiveTracker, op: str, tensors: tuple, nbytes: int | None,
                     group: Any) -> Iterator[None]:
    """Times the blocking call inside the block: on the CUDA device's stream where the tensors are
    on the rank's device (a ``Monitor()`` made without a device learns it here at the latest),
    on the host clock otherwise. ``nbytes`` defaults to the tensors' size; ``group`` (default: the
    world) gives the group size its bus bandwidth needs."""
    check_op(op)
    size = tensor_nbytes(tensors) if nbytes is None else nbytes
    size_of_group = group_size(group)
    device = tracker.device
    cuda = device.device_of(list(tensors))
    if cuda is not None:
        device.bind(cuda)
    if cuda is not None and device.events is not None:
        span = tracker.begin_device(op, size, group_size=size_of_group)
        try:
            yield
        finally:
            tracker.end_device(span)
    else:
        token, t0, start = tracker.begin(op)
        try:
            yield
        finally:
            tracker.end(token, op, size, t0, start, group_size=size_of_group)
