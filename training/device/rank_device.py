"""The rank's CUDA device, as its timings and deferred values see it.

Known from ``Monitor(device=...)``; else from the first CUDA model given to
``watch()``, or the first CUDA value a step observes (``bind``). Until then the
rank is timed on the host clock, as on a CPU. ``Monitor(device="cuda")``
without an index is resolved at the first step, on the training thread: a
Monitor is often made before the loop calls ``torch.cuda.set_device``, and
the device current then (0) is not the rank's.

Every CUDA event is recorded on *this* device's current stream
(``stream()``), never on "the current stream" of whatever device the calling
thread has current: a training thread that never called
``torch.cuda.set_device`` has device 0 current, and an event recorded there
times an idle stream, is not ordered after the loss's copy (so the copy
could be read before it lands), and, once the pool holds events of another
device, raises inside the user's loop. Other threads touch the device only
inside ``on_device()`` (rankscope.device.cuda).
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterator

from rankscope.device import cuda as cuda_api
from rankscope.device.reads import DeviceReads

if TYPE_CHECKING:
    import torch

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

    def __init__(self, on_drop: Callable[[str, str], None], cuda: cuda_api.Cuda | None = None):
        self._on_drop = on_drop
        self.api = cuda if cuda is not None else cuda_api.api()   # every CUDA call goes through it
        self.index = -1
        self.name = ""                   # the GPU's name, for the peak-FLOPS table
        self.sm_count = 0                # its streaming multiprocessors (a MIG slice has fewer)
        self.total_memory = 0
        self.uuid = ""
        self.unresolved = False          # Monitor(device="cuda"): the index is read at the first step
        self.events: EventPool | None = None
        self.reads: DeviceReads | None = None   # once bound
        self._warned = False

    @property
    def cuda(self) -> bool:
        return self.events is not None

    def bind(self, device: Any) -> bool:
        """Time on ``device`` from now on, if it is a CUDA device; True if this changed anything.

        A second, different device is taken only while no event was created yet (a model on
        cuda:3 after ``Monitor(device="cuda:0")``); after that it is logged once and ignored."""
        if device is None:
            return False
        index = self.api.resolve(device)
        if index is None:
            if self.api.is_cuda_device(device) and self.events is None:
                self.unresolved = True   # "cuda": the training thread's device at the first step
            return False
        return self._bind_index(index)

    def bind_current(self) -> bool:
        """Training thread, at a step's start: resolve ``Monitor(device="cuda")`` now that the loop
        has set its device."""
        self.unresolved = False
        return self._bind_index(self.api.current_device())

    def _bind_index(self, index: int) -> bool:
        if self.events is not None:
            if index == self.index:
                return False
            if self.events.created:
                if not self._warned:
                    self._warned = True
                    log.warning("rankscope: timing on cuda:%d; cuda:%d (a model or value on another GPU) is not "
                                "timed: give Monitor(device=...) the rank's own GPU", self.index, index)
                return False
        properties = self.api.properties(index)
        self.name, self.sm_count = properties.name, properties.sm_count
        self.total_memory, self.uuid = properties.total_memory, properties.uuid
        self.index = index
        self.unresolved = False
        events = EventPool(self.api.timing_event)
        self.reads = DeviceReads(events, self._on_drop, self)
        self.events = events   # last: a thread that sees events sees the rest
        return True

    def stream(self) -> Any:
        """This device's current stream: what the training thread's work on it is queued on."""
        return self.api.stream(self.index)

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether a CUDA tensor is on this device."""
        return self.api.device_of(tensor) == self.index

    def device_of(self, value: Any) -> int | None:
        """The CUDA device index of a tensor, or of the first CUDA tensor in a list or tuple; else None."""
        index = self.api.device_of(value) if hasattr(value, "get_device") else None
        if index is None and isinstance(value, (list, tuple)):
            for item in value:
                if hasattr(item, "get_device"):
                    index = self.api.device_of(item)
                    if index is not None:
                        break
        return index

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """Any thread but the training thread: the block's CUDA calls run with this device current
        (a no-op before a device is known)."""
        if self.events is None:
            yield
            return
        with self.api.on(self.index):
            yield

    def first_cuda_index(self, model: torch.nn.Module) -> int | None:
        """The device of a module's first CUDA parameter or buffer, else None."""
        for tensors in (model.parameters(), model.buffers()):
            for t in tensors:
                index = self.api.device_of(t)
                if index is not None:
                    return index
        return None
