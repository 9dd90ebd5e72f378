"""The one place rankscope calls CUDA: ``Cuda``, and the events and streams it hands out.

Every CUDA call rankscope makes goes through the object ``api()`` returns, and
each is made on a thread that may make it:

* **the training thread** only queues work: it records events on the rank
  device's stream and copies a value to pinned memory without blocking. It
  never waits for the device (no ``synchronize``, ``.item()``, ``.tolist()``,
  ``.cpu()`` or blocking copy of a device tensor), and never changes the
  thread's current device: that is the user's.
* **every other thread** (the publisher, the process-group reader, and torch's
  threads that rankscope's calls run on) touches the device only inside
  ``on(index)``. A new thread's current device is 0, and a call without a
  device guard there (``Event.query()``, NCCL's flight recorder, which queries
  its collectives' events) makes a CUDA context on GPU 0: about 0.5 GiB of it
  in every rank of a node where each rank sees every GPU.

Tests swap in a strict double of this class (tests/helpers/strict_cuda.py)
with ``use()``: it fails a test on any call above made on the wrong thread, on
the wrong device, or one that would wait for the device, so that the CPU suite
catches this class of defect without a GPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DeviceProperties:
    name: str            # the GPU's name (torch reads NVML's), for the peak-FLOPS table
    sm_count: int        # its streaming multiprocessors (a MIG slice has fewer)
    total_memory: int    # bytes
    uuid: str            # as torch prints it (without NVML's "GPU-" prefix)


class Cuda:
    """``torch.cuda`` as rankscope uses it. Imported lazily: a CPU job never loads CUDA."""

    # -- any thread: no device touched ------------------------------------------------
    def available(self) -> bool:
        import torch

        return torch.cuda.is_available()

    def device_of(self, tensor: object) -> int | None:
        """The CUDA device index of a tensor, None for anything else (``get_device`` is the cheap C call)."""
        return tensor.get_device() if getattr(tensor, "is_cuda", False) else None

    def resolve(self, device: Any) -> int | None:
        """A CUDA device's index (``"cuda:3"``, ``torch.device``, an int) or None for another kind;
        ``"cuda"`` without an index is None too: it is read at the first step (``current_device``).
        Raises on something that is no device."""
        import torch

        if isinstance(device, int):
            device = torch.device("cuda", device)
        device = torch.device(device)
        if device.type != "cuda":
            return None
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available")
        return device.index

    def is_cuda_device(self, device: Any) -> bool:
        return getattr(device, "type", None) == "cuda" or str(device).startswith("cuda")

    def properties(self, index: int) -> DeviceProperties:
        import torch

        p = torch.cuda.get_device_properties(index)
        return DeviceProperties(p.name, int(getattr(p, "multi_processor_count", 0)), int(p.total_memory),
                                str(getattr(p, "uuid", "")))

    def memory_stats(self, index: int) -> dict[str, Any]:
        """The caching allocator's counters: host-side, no sync."""
        import torch

        return torch.cuda.memory_stats(index)

    def nccl_version(self) -> str:
        import torch

        return ".".join(map(str, torch.cuda.nccl.version()))

    # -- the training thread: queue work, never wait -----------------------------------
    def current_device(self) -> int:
        """The calling thread's current device: the training thread's, once the user set it."""
        import torch

        return torch.cuda.current_device()

    def stream(self, index: int) -> Any:
        """The device's current stream on this thread: what the training thread's work is queued on."""
        import torch

        return torch.cuda.current_stream(index)

    def timing_event(self) -> Any:
        """An event with ``record(stream)``, ``query()`` and ``elapsed_time(end)`` (ms)."""
        import torch

        return torch.cuda.Event(enable_timing=True)

    def pinned_buffer(self, dtype: torch.dtype, shape: tuple[int, ...] = ()) -> Any:
        import torch

        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def copy_to_host(self, host: torch.Tensor, tensor: torch.Tensor) -> None:
        """Queue a device-to-host copy on the tensor's device's current stream; no wait."""
        host.copy_(tensor, non_blocking=True)

    # -- other threads: inside the device's guard ---------------------------------------
    @contextlib.contextmanager
    def on(self, index: int) -> Iterator[None]:
        """Make ``index`` the calling thread's device for the block. On leaving, the previous device
        is made current again only where it already has a context (torch's guard): a thread that
        started on device 0 gets no context there."""
        import torch

        with torch.cuda.device(index):
            yield

    def call_on(self, index: int, call: Callable[..., Any], *args: object) -> Any:
        """``call(*args)``, a torch call that may query CUDA events (NCCL's flight recorder), with
        ``index`` current."""
        with self.on(index):
            return call(*args)


_api: Cuda = Cuda()


def api() -> Cuda:
    """The CUDA API in use (the real one, or a test's double)."""
    return _api


@contextlib.contextmanager
def use(double: Cuda) -> Iterator[Cuda]:
    """Route rankscope's CUDA calls to ``double`` for the block (tests). Objects made before keep
    the API they were given."""
    global _api
    previous, _api = _api, double
    try:
        yield double
    finally:
        _api = previous
