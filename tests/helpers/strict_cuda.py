"""A strict double of rankscope's CUDA boundary (rankscope.device.cuda), for the CPU suite.

Every tensor counts as living on ``tensor_device`` (the rank's GPU unless a test
says otherwise), except the pinned host buffers the double hands out. The
double fails the test (``violations``, checked when its block ends) when:

* a thread makes a call that uses its current device (``Event.query()``, a
  flight-recorder read that queries NCCL's events: ``touch``) before setting
  one, or with another device than the rank's current: on a GPU, that call
  makes a CUDA context on GPU 0;
* the training thread makes a blocking call: ``synchronize``,
  ``Event.synchronize``, or, from rankscope's code (directly or through a
  framework's), ``.item()``, ``.tolist()``, ``.cpu()``, ``bool()``/``float()``
  of a device tensor, a copy into a host buffer or ``.to("cpu")`` without
  ``non_blocking`` (the nearest caller outside torch and the frameworks is
  blamed: a framework's own sync in its own loop is not rankscope's);
* an event is recorded on a stream of another device than the rank's, or
  re-recorded on another device than its first;
* ``elapsed_time`` is read on an event that has not completed (it would wait).

The training thread is the thread that enters the block; ``set_device`` is the
user's ``torch.cuda.set_device`` on it.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

import rankscope
from rankscope.device import cuda as cuda_api

RANKSCOPE_DIRS = tuple(str(Path(p).resolve()) for p in rankscope.__path__)
# Frames skipped when looking for whose code made a blocking call: the libraries rankscope calls
# into, and this double. The first frame left is the caller that is to blame.
LIBRARY_PARTS = ("/torch/", "/lightning/", "/pytorch_lightning/", "/lightning_fabric/", "/lightning_utilities/",
                 "/transformers/",
                 "/accelerate/", "/torchtitan/", "/contextlib.py", "/functools.py", "/threading.py", "/warnings.py")
BLOCKING = frozenset({"item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__",
                      "__complex__", "synchronize"})


class StrictStream:
    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"<stream of cuda:{self.index}>"


class StrictEvent:
    def __init__(self, cuda: "StrictCuda"):
        self._cuda = cuda
        self.device: int | None = None
        self.stream: StrictStream | None = None
        self.t = 0.0
        self.done = False

    def record(self, stream: Any = None) -> None:
        cuda = self._cuda
        if not isinstance(stream, StrictStream):
            cuda.violation(f"an event recorded on {stream!r}, not on a device's stream (the current device's stream, "
                           "whichever that is)")
            return
        if cuda.fail_records_in and sys._getframe(1).f_code.co_name == cuda.fail_records_in:
            raise RuntimeError(f"CUDA error: an injected failure to record an event in {cuda.fail_records_in}()")
        if stream.index != cuda.rank_device:
            cuda.violation(f"an event recorded on {stream!r}: the rank's device is cuda:{cuda.rank_device}")
        if self.device is not None and self.device != stream.index:
            cuda.violation(f"an event of cuda:{self.device} re-recorded on {stream!r}")
        self.device, self.stream, self.t = stream.index, stream, time.perf_counter()
        self.done = False
        if cuda.holding:
            cuda.held.append(self)
        else:
            self.done = True

    def query(self) -> bool:
        self._cuda.touch("Event.query()")
        return self.done

    def elapsed_time(self, end: "StrictEvent") -> float:
        if not (self.done and end.done):
            self._cuda.violation("elapsed_time() of an event that has not completed: it waits for the device")
        return (end.t - self.t) * 1000.0

    def synchronize(self) -> None:
        self._cuda.blocking("Event.synchronize()")


class StrictCuda(cuda_api.Cuda):
    def __init__(self, rank_device: int = 1, tensor_device: int | None = None):
        self.rank_device = rank_device
        self.tensor_device = rank_device if tensor_device is None else tensor_device
        self.training_thread = threading.get_ident()
        self.violations: list[str] = []
        self.holding = False            # events recorded now complete only at release()
        self.held: list[StrictEvent] = []
        self.fail_records_in = ""       # event records made by the function of this name raise
        self.touched: list[tuple[str, int]] = []   # (thread name, device) of every device-current call
        self._local = threading.local()
        # The pinned buffers handed out, by id, kept alive so that no id is reused (a WeakSet's
        # lookup would compare tensors with ==).
        self._host: dict[int, Any] = {}
        self._streams: dict[int, StrictStream] = {}
        self._lock = threading.Lock()

    # -- the test's side -----------------------------------------------------------------
    def __enter__(self) -> "StrictCuda":
        self._use = cuda_api.use(self)
        self._use.__enter__()
        self._mode = BlockingCallCheck(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        self._use.__exit__(*exc)
        if exc[0] is None:
            self.check()

    def check(self) -> None:
        assert not self.violations, "rankscope broke the CUDA rules:\n  " + "\n  ".join(self.violations)

    def set_device(self, index: int) -> None:
        """The user's torch.cuda.set_device, on the calling thread."""
        self._local.current = index

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Events recorded in the block complete only when it ends (the device is still busy)."""
        self.holding = True
        try:
            yield
        finally:
            self.holding = False

    def release(self) -> None:
        for event in self.held:
            event.done = True
        self.held.clear()

    def violation(self, what: str) -> None:
        with self._lock:
            self.violations.append(f"[{threading.current_thread().name}] {what}")

    def touch(self, what: str) -> None:
        current = getattr(self._local, "current", None)
        if current is None:
            self.violation(f"{what} before this thread set its device: CUDA makes a context on GPU 0 for it")
        elif current != self.rank_device:
            self.violation(f"{what} with cuda:{current} current: the rank's device is cuda:{self.rank_device}")
        self.touched.append((threading.current_thread().name, -1 if current is None else current))

    def blocking(self, what: str, where: str = "") -> None:
        if threading.get_ident() == self.training_thread:
            self.violation(f"{what} on the training thread waits for the device{where}")

    def is_host(self, tensor: Any) -> bool:
        return id(tensor) in self._host

    # -- rankscope.device.cuda.Cuda ----------------------------------------------------------
    def available(self) -> bool:
        return True

    def device_of(self, tensor: Any) -> int | None:
        if not isinstance(tensor, torch.Tensor) or id(tensor) in self._host:
            return None
        return self.tensor_device

    def resolve(self, device: Any) -> int | None:
        if isinstance(device, int):
            return device
        text = str(device) if not hasattr(device, "type") else f"{device.type}:{device.index}"
        if not text.startswith("cuda"):
            return None
        index = text.partition(":")[2]
        return int(index) if index not in ("", "None") else None

    def is_cuda_device(self, device: Any) -> bool:
        return str(getattr(device, "type", device)).startswith("cuda")

    def properties(self, index: int) -> cuda_api.DeviceProperties:
        return cuda_api.DeviceProperties("NVIDIA H100 80GB HBM3", 132, 80 * 2**30, f"0000000{index}-strict-double")

    def memory_stats(self, index: int) -> dict[str, Any]:
        return {"allocated_bytes.all.current": 2**20, "reserved_bytes.all.current": 2**21,
                "allocated_bytes.all.peak": 2**20, "num_alloc_retries": 0, "num_ooms": 0}

    def nccl_version(self) -> str:
        return "2.27.5"

    def current_device(self) -> int:
        return getattr(self._local, "current", None) or 0

    def stream(self, index: int) -> StrictStream:
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = StrictStream(index)
        return stream

    def timing_event(self) -> StrictEvent:
        return StrictEvent(self)

    def pinned_buffer(self, dtype: Any, shape: tuple[int, ...] = ()) -> Any:
        host = torch.empty(shape, dtype=dtype)
        self._host[id(host)] = host
        return host

    def copy_to_host(self, host: Any, tensor: Any) -> None:
        if id(host) not in self._host:
            self.violation("copy_to_host() into a tensor that is not a pinned host buffer: it would block")
        with torch._C.DisableTorchFunction():
            host.copy_(tensor.detach())

    @contextlib.contextmanager
    def on(self, index: int) -> Iterator[None]:
        previous = getattr(self._local, "current", None)
        self._local.current = index
        try:
            yield
        finally:
            self._local.current = previous

    def synchronize(self) -> None:
        self.blocking("torch.cuda.synchronize()")


class BlockingCallCheck(TorchFunctionMode):
    """On the training thread (torch function modes are per thread): a blocking read of a device
    tensor whose nearest caller outside the libraries is rankscope's code is a violation."""

    def __init__(self, cuda: StrictCuda):
        super().__init__()
        self.cuda = cuda

    def __torch_function__(self, func: Callable, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        blocking = name in BLOCKING
        if name == "copy_" and len(args) >= 2 and not kwargs.get("non_blocking", False):
            blocking = isinstance(args[0], torch.Tensor) and self.cuda.is_host(args[0])
        elif name == "to" and not kwargs.get("non_blocking", False):
            # Only a literal "cpu": a torch.device taken from a tensor (torch's own clip_grad_norm_
            # moves its result to the gradients' device) is the GPU's on a GPU, the host's here.
            blocking = any(isinstance(a, str) and a.startswith("cpu") for a in list(args[1:]) + [kwargs.get("device")])
        if blocking and args and isinstance(args[0], torch.Tensor) and self.cuda.device_of(args[0]) is not None:
            culprit = rankscope_caller(sys._getframe(1))
            if culprit:
                self.cuda.blocking(f"{name}() of a device tensor", f", called from {culprit}")
        return func(*args, **kwargs)


def rankscope_caller(frame: Any) -> str:
    """'file:line in function' of the nearest frame from ``frame`` outwards that is outside the
    libraries, if it is rankscope's (also used by tests/gpu, on sync-debug warnings).

    rankscope's wrappers that run a framework's own function in its place are named
    ``rankscope_<function>`` (the HF adapter's ``rankscope_training_step``): what that function
    does below them is the framework's, not rankscope's."""
    through_library = False
    while frame is not None:
        path = frame.f_code.co_filename
        if path == __file__ or any(part in path for part in LIBRARY_PARTS):
            through_library = True
        elif path.startswith(RANKSCOPE_DIRS):
            if through_library and frame.f_code.co_name.startswith("rankscope_"):
                return ""
            return f"{Path(path).name}:{frame.f_lineno} in {frame.f_code.co_name}"
        else:
            return ""
        frame = frame.f_back
    return ""


def in_thread(call: Callable[[], Any], name: str = "not-the-training-thread") -> Any:
    """``call()`` on a new thread (its current device unset, as on a GPU), returning its result."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = call()
        except BaseException as e:  # re-raised on the caller's thread
            out["error"] = e

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")
