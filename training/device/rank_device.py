"""The rank's CUDA device, as its timings and deferred values see it.

Known from ``Monitor(device=...)``; else from the first CUDA model given to
``watch()``, or the first CUDA value a step observes (``bind``). Until then the
rank is timed on the host clock, as on a CPU.

Every CUDA event is recorded on *this* device's current stream
(``stream()``), never on "the current stream" of whatever device the calling
thread has current: a training thread that never called
``torch.cuda.set_device`` has device 0 current, and an event recorded there
times an idle stream, is not ordered after the loss's copy (so the copy
could be read before it lands), and, once the pool holds events of another
device, raises inside the user's loop. An index-less ``cuda`` device is
resolved to an index here, on the training thread: the publisher thread's
current device is always 0.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from rankscope.device.reads import DeviceReads

log = logging.getLogger("rankscope")


class EventPool:
    """Reuses CUDA timing events: creating one per collective would allocate on the hot path."""

    def __init__(self, factory: Callable[[], Any], size: int = 256):
        self._factory = factory
        self._free: list[Any] = []
        self._size = size
        self.created = 0

    def get(self):
        if self._free:
            return self._free.pop()
        self.created += 1
        return self._factory()

    def put(self, event) -> None:
        if len(self._free) < self._size:
            self._free.append(event)


class RankDevice:
    """The CUDA device this rank's events and values are on; ``events`` is None until one is known.

    Shared by the step timer, the collective tracker and the step accounting (training
    thread), and the publisher (which reads ``reads`` and the device's memory)."""

    def __init__(self, on_drop: Callable[[str, str], None]):
        self._on_drop = on_drop
        self.device: Any = None          # torch.device("cuda", index) once bound
        self.index = -1
        self.name = ""                   # the GPU's name (torch reads NVML's), for the peak-FLOPS table
        self.sm_count = 0                # its streaming multiprocessors (a MIG slice has fewer)
        self.events: EventPool | None = None
        self.reads: DeviceReads | None = None   # once bound
        self._stream: Callable[[Any], Any] = lambda device: None
        self._warned = False

    @property
    def cuda(self) -> bool:
        return self.events is not None

    def bind(self, device: Any, *, event_factory: Callable[[], Any] | None = None,
             stream: Callable[[Any], Any] | None = None) -> bool:
        """Time on ``device`` from now on, if it is a CUDA device; True if this changed anything.

        A second, different device is taken only while no event was created yet (a
        ``Monitor(device="cuda")`` made before ``set_device``, then a model on cuda:3);
        after that it is logged once and ignored. ``event_factory`` and ``stream`` stand in
        for torch's in tests."""
        if device is None:
            return False
        if event_factory is None:
            import torch

            device = torch.device(device)
            if device.type != "cuda":
                return False
            index = device.index if device.index is not None else torch.cuda.current_device()
        else:
            index = getattr(device, "index", None) or 0
        if self.events is not None:
            if index == self.index:
                return False
            if self.events.created:
                if not self._warned:
                    self._warned = True
                    log.warning("rankscope: timing on cuda:%d; cuda:%d (a model or value on another GPU) is not "
                                "timed: give Monitor(device=...) the rank's own GPU", self.index, index)
                return False
        if event_factory is None:
            import torch

            self.device = torch.device("cuda", index)
            properties = torch.cuda.get_device_properties(index)
            self.name, self.sm_count = properties.name, int(getattr(properties, "multi_processor_count", 0))
            event_factory = _timing_event
            stream = torch.cuda.current_stream
        else:
            self.device = device
        self.index = index
        self._stream = stream or (lambda device: None)
        events = EventPool(event_factory)
        self.reads = DeviceReads(events, self._on_drop, self)
        self.events = events   # last: a thread that sees events sees the rest
        return True

    def stream(self) -> Any:
        """This device's current stream: what the training thread's work on it is queued on."""
        return self._stream(self.device)

    def owns(self, tensor: Any) -> bool:
        """Whether a CUDA tensor is on this device (``get_device`` is the cheap C call)."""
        return tensor.get_device() == self.index


def _timing_event() -> Any:
    import torch

    return torch.cuda.Event(enable_timing=True)


def first_cuda_device(model: Any) -> Any:
    """The device of a module's first CUDA parameter or buffer, else None."""
    for tensors in (model.parameters(), model.buffers()):
        for t in tensors:
            if getattr(t, "is_cuda", False):
                return t.device
    return None
