"""CUDA values and step timings, read once the device has finished them (never waited for).

The host returns from a CUDA step long before the device finishes it. A loss
on the device is copied to pinned host memory without blocking, with an event
recorded after the copy; a step's phases are bracketed by event pairs. The
publisher thread checks the events with ``query()`` and reads what is ready,
in order. Nothing here calls ``synchronize()``.

Both queues are bounded; what arrives while one is full is counted as a drop
(``device_value`` / ``device_step``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

from rankscope.contract.catalog import PHASES

if TYPE_CHECKING:
    import torch

    from rankscope.device.cuda import Cuda
    from rankscope.step.records import TraceContext

MAX_PENDING = 1024
MAX_FREE_PINNED = 64   # per dtype: more than the values in flight at once


@dataclass(slots=True)
class DeviceValue:
    what: str            # "loss", "grad_norm" or "lr"
    host: torch.Tensor            # pinned 0-d tensor the value is copied into
    ready: Any           # event recorded after the copy (from the event pool)
    step: Any            # the step's trace context (steps.TraceContext), or None


@dataclass(slots=True)
class DeviceStep:
    """A CUDA step whose phase events are not read yet."""

    duration: float                      # host wall clock, data wait included
    data: float                          # host-measured data wait
    phases: list[tuple[str, Any, Any]]   # (name, start event, end event)
    last_bucket: Any                     # the step's last-launched bucket span (bounds the exposed wait)


class Events(Protocol):
    """The CUDA event pool the reads take events from and give back (``rank_device.EventPool``)."""

    def get(self) -> torch.cuda.Event: ...

    def put(self, event: torch.cuda.Event) -> None: ...


class CopyDevice(Protocol):
    """What the reads need of the rank's device (``rank_device.RankDevice``): where a tensor is,
    and the stream its copies are ordered on."""

    index: int | None
    api: Cuda

    def owns(self, tensor: torch.Tensor) -> bool: ...

    def device_of(self, value: object) -> int | None: ...

    def stream(self) -> torch.cuda.Stream: ...


class DeviceReads:
    def __init__(self, events: Events, on_drop: Callable[[str, str], None], device: CopyDevice | None = None):
        self.events = events                 # the CUDA event pool (device.EventPool)
        self._on_drop = on_drop
        self._device = device                # device.RankDevice: whose stream the copies are ordered on
        self._values: deque[DeviceValue] = deque()
        self._steps: deque[DeviceStep] = deque()
        self._user: deque[tuple[Any, Any, Callable[[float], None]]] = deque()   # (host, ready, deliver)
        self._arrays: deque[tuple[Any, Any, Callable[[list], None]]] = deque()  # (host, ready, deliver)
        # (dtype, shape) -> pinned buffers whose value was read (appended by the publisher, popped by
        # the training thread)
        self._free_pinned: dict[tuple[Any, tuple[int, ...]], list[Any]] = {}

    # -- training thread -------------------------------------------------------
    def defer_value(self, what: str, tensor: torch.Tensor, step: TraceContext | None) -> None:
        """Copy a 0-d tensor of the rank's device to pinned memory; ``ready`` is recorded on the
        same stream as the copy (that device's current one), so it completes only once the copy has."""
        copied = self._copy(what, tensor, self._values)
        if copied is not None:
            self._values.append(DeviceValue(what, *copied, step))

    def defer_user_value(self, what: str, tensor: torch.Tensor, deliver: Callable[[float], None]) -> None:
        """A user metric's 0-d device value: ``deliver(number)`` runs on the publisher once it is copied."""
        copied = self._copy(what, tensor, self._user)
        if copied is not None:
            self._user.append((*copied, deliver))

    def defer_array(self, what: str, tensor: torch.Tensor, deliver: Callable[[list], None]) -> None:
        """A device tensor of any shape (a replica fingerprint's sums): ``deliver(values)``, its
        elements as a list, runs on the publisher once it is copied."""
        copied = self._copy(what, tensor, self._arrays)
        if copied is not None:
            self._arrays.append((*copied, deliver))

    def _copy(self, what: str, tensor: torch.Tensor, queue: deque) -> tuple[Any, Any] | None:
        device = self._device
        if not device.owns(tensor):
            self._on_drop("value", f"{what} is on cuda:{device.device_of(tensor)}, the monitor times "
                                   f"cuda:{device.index}: give Monitor(device=...) the rank's own GPU")
            return None
        if not self._room(queue, "device_value"):
            return None
        host = self._pinned(tensor.dtype, tuple(tensor.shape))
        device.api.copy_to_host(host, tensor)
        ready = self.events.get()
        ready.record(device.stream())
        return host, ready

    def _pinned(self, dtype: torch.dtype, shape: tuple[int, ...] = ()) -> Any:
        """A pinned buffer, reused once its value has been read: no allocation per step."""
        free = self._free_pinned.get((dtype, shape))
        if free:
            return free.pop()
        return self._device.api.pinned_buffer(dtype, shape)

    def defer_step(self, step: DeviceStep) -> None:
        if self._room(self._steps, "device_step"):
            self._steps.append(step)

    def _room(self, queue: deque, what: str) -> bool:
        """Whether one more fits. A full queue drops the newcomer, counted: only the publisher
        takes from a queue, so an entry it is reading is never taken from under it (and a
        buffer whose copy is pending never goes back to the pool)."""
        if len(queue) < MAX_PENDING:
            return True
        self._on_drop(what, f"more than {MAX_PENDING} waiting for the device")
        return False

    # -- publisher thread (inside RankDevice.on_device) -------------------------
    def ready_values(self) -> list[tuple[str, float, Any]]:
        """``(what, number, step)`` of the values whose copy has finished, in order; never
        blocks. Their buffer and event go back for the next steps."""
        out = []
        values = self._values
        while values and values[0].ready.query():
            value = values.popleft()
            out.append((value.what, float(value.host), value.step))
            self._release(value.host, value.ready)
        return out

    def deliver_user_values(self) -> int:
        """Hands each copied user value to its metric, in order; never blocks. Returns how many."""
        done = 0
        user = self._user
        while user and user[0][1].query():
            host, ready, deliver = user.popleft()
            number = float(host)
            self._release(host, ready)
            deliver(number)
            done += 1
        return done

    def deliver_arrays(self) -> None:
        """Hands each copied array to its reader, in order; never blocks."""
        arrays = self._arrays
        while arrays and arrays[0][1].query():
            host, ready, deliver = arrays.popleft()
            values = host.tolist()
            self._release(host, ready)
            deliver(values)

    def _release(self, host: torch.Tensor, ready: torch.cuda.Event) -> None:
        self.events.put(ready)
        free = self._free_pinned.setdefault((host.dtype, tuple(host.shape)), [])
        if len(free) < MAX_FREE_PINNED:
            free.append(host)

    def ready_steps(self) -> list[dict[str, float]]:
        """Phase seconds of the finished steps, in order; never blocks.

        The exposed communication wait is the part of the last bucket's
        all-reduce that outlasted backward's compute, bounded by backward."""
        out = []
        steps = self._steps
        while steps:
            step = steps[0]
            if not all(end.query() for _, _, end in step.phases):
                break
            if step.last_bucket is not None and step.last_bucket.duration is None:
                break   # its all-reduce is still being read by the collective tracker
            steps.popleft()
            out.append(self._phase_seconds(step))
        return out

    def _phase_seconds(self, step: DeviceStep) -> dict[str, float]:
        device = dict.fromkeys(PHASES, 0.0)
        for name, start, end in step.phases:
            device[name] += start.elapsed_time(end) / 1000.0
            self.events.put(start)
            self.events.put(end)
        if step.last_bucket is not None:
            exposed = min(step.last_bucket.duration, device["backward"])
            device["backward"] -= exposed
            device["comm_wait"] += exposed
        device["data"] = 0.0  # already counted from the host clock
        device["other"] += max(step.duration - step.data - sum(device.values()), 0.0)
        return device
