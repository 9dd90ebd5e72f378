"""The flight recorders' two reads, from torch's C++ bindings and its worker server.

torch (>= 2.7) records every collective of every process group in a flight recorder (a ring
of ``TORCH_FR_BUFFER_SIZE`` entries, 2000 by default since torch 2.11). There are two: gloo
and the other CPU backends record into libtorch_cpu's, and ProcessGroupNCCL into its own in
libtorch_cuda, reached only through the NCCL entry points (``_dump_nccl_trace_json``, the
worker server's ``dump_nccl_trace_json`` handler). ``FlightRecorderSource`` reads each one's
status (per group the last enqueued / completed sequence number) and its whole ring as JSON
(rankscope.collectives.group_reader decides when, and decodes the entries).

The ring's JSON is fetched from torch's own C++ worker server
(``torch._C._distributed_c10d._WorkerServer``, handler ``fr_trace_json``) on a unix socket in
the run directory: the ring is serialised on the server's C++ thread without the GIL
(docs/collectives.md).
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import os
import socket
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rankscope.device.rank_device import RankDevice


# The flight recorders torch has, by name: (the status call of its C++ bindings, the worker
# server's handler for its whole ring as JSON). "cpu" records gloo and the other CPU backends,
# "nccl" ProcessGroupNCCL (CUDA builds only).
RECORDERS = {
    "cpu": ("_dump_fr_trace_json", "/handler/fr_trace_json"),
    "nccl": ("_dump_nccl_trace_json", "/handler/dump_nccl_trace_json?includecollectives=true&onlyactive=false"),
}


def available_recorders(c10d: Any = None) -> tuple[str, ...]:
    """The recorders this torch build has. Where torch records every backend into the generic
    recorder too (``FlightRecorderHook``, after 2.13), that one alone: reading both would count
    each NCCL collective twice."""
    if c10d is None:
        import torch

        c10d = getattr(torch._C, "_distributed_c10d", None)
    if c10d is not None and hasattr(c10d, "FlightRecorderHook"):
        return ("cpu",) if hasattr(c10d, RECORDERS["cpu"][0]) else ()
    return tuple(name for name, (status, _) in RECORDERS.items() if c10d is not None and hasattr(c10d, status))


def recorder_holds_cuda_events(recorder: str, c10d: Any) -> bool:
    """Whether reading ``recorder`` queries CUDA events (NCCL's collectives): such a read must run
    with the rank's device current (rankscope.device.cuda)."""
    return recorder == "nccl" or hasattr(c10d, "FlightRecorderHook")


_FETCH_CHUNK = 256 * 1024   # bytes of the ring's JSON received per GIL release


class FlightRecorderSource:
    """The two reads of each of torch's flight recorders; replaceable in tests.

    NCCL's recorder queries the CUDA events of its unfinished collectives when read, on the
    calling thread: with no device current there, that makes a CUDA context on GPU 0. So it
    is read only once the rank's device is known, inside its guard, and its ring is serialised
    by torch's worker server (a thread of torch's, whose current device is 0) only where the
    rank's device *is* 0 (one GPU per rank through CUDA_VISIBLE_DEVICES, or local rank 0);
    elsewhere on this thread, holding the GIL while torch serialises it (docs/collectives.md)."""

    def __init__(self, socket_dir: Path, rank: int, recorders: tuple[str, ...] | None = None,
                 device: RankDevice | None = None, c10d: Any = None):
        self._socket_dir = socket_dir
        self._rank = rank
        self._device = device                 # rankscope.device.RankDevice, or None (no CUDA here)
        self._c10d = c10d                     # torch._C._distributed_c10d (a test's double)
        self.recorders = available_recorders(c10d) if recorders is None else recorders
        self._server: Any = None
        self._path = ""

    @property
    def c10d(self) -> Any:
        if self._c10d is None:
            import torch

            self._c10d = torch._C._distributed_c10d
        return self._c10d

    def _on_device(self, recorder: str) -> bool | None:
        """None: the recorder cannot be read yet (CUDA events, no device known); else whether its
        reads need the device's guard."""
        if not recorder_holds_cuda_events(recorder, self.c10d):
            return False
        device = self._device
        return True if device is not None and device.cuda else None

    def status(self, recorder: str = "cpu") -> dict[str, dict[str, str]]:
        call = getattr(self.c10d, RECORDERS[recorder][0])
        guarded = self._on_device(recorder)
        if guarded is None:
            return {}
        raw = self._device.api.call_on(self._device.index, call, False, False) if guarded else call(False, False)
        return json.loads(raw).get("pg_status", {})

    def holds_gil(self, recorder: str) -> bool:
        """Whether reading ``recorder``'s entries holds the GIL throughout (serialised on the calling
        thread rather than by the worker server)."""
        return bool(self._on_device(recorder)) and self._device.index != 0

    def entries_json(self, recorder: str = "cpu") -> bytes | bytearray:
        """The whole ring as JSON, serialised by torch's C++ worker server (no GIL held meanwhile),
        or by the recorder's own call on this thread where the server's thread would touch
        another device than the rank's (see the class docstring).

        Read in chunks into one buffer allocated up front: a full 20,000-entry ring (torchtitan's
        size) is ~15 MB, and reading it whole builds the bytes object under the GIL (a 6.5 ms
        stop for the training thread); each chunk's receive lets the GIL go."""
        guarded = self._on_device(recorder)
        if guarded is None:
            return b""
        if guarded and self._device.index != 0:
            call = getattr(self.c10d, RECORDERS[recorder][0])
            return self._device.api.call_on(self._device.index, call, True, False)
        if self._server is None:
            self._start()
        conn = _UnixHTTPConnection(self._path)
        try:
            conn.request("POST", RECORDERS[recorder][1])
            resp = conn.getresponse()
            if resp.status != 200:
                raise OSError(f"flight recorder server answered {resp.status}")
            length = resp.length
            if length is None:   # no Content-Length: read to the end
                return bytearray(resp.read())
            body = bytearray(length)   # calloc: pages are zeroed by the kernel as they are touched
            view, got = memoryview(body), 0
            while got < length:
                n = resp.readinto(view[got:got + _FETCH_CHUNK])
                if not n:
                    raise OSError(f"flight recorder server closed after {got} of {length} bytes")
                got += n
            view.release()
            return body
        finally:
            conn.close()

    def _start(self) -> None:
        _WorkerServer = self.c10d._WorkerServer
        path = self._socket_dir / f"fr-{self._rank}-{os.getpid()}.sock"
        if len(str(path)) > 100:   # sun_path holds 108 bytes
            path = Path(tempfile.mkdtemp(prefix="rankscope-fr-")) / "fr.sock"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        with _c10_warnings_quiet():
            self._server = _WorkerServer(str(path))
        os.chmod(path, 0o600)   # the server also answers stack dumps: this user only
        self._path = str(path)

    def close(self) -> None:
        if self._server is not None:
            try:
                with _c10_warnings_quiet():
                    self._server.shutdown()
            finally:
                self._server = None
                Path(self._path).unlink(missing_ok=True)


@contextlib.contextmanager
def _c10_warnings_quiet():
    """torch's worker server announces its start and stop as warnings on every rank ("Server
    listening to UNIX ...", "shutting down", "exited"): nothing the user asked for. c10's log
    level is raised to errors for just those two calls (a c10 warning another thread logs in
    that millisecond is lost with them); where the level cannot be reached, nothing changes."""
    level = _c10_log_level()
    if level is None:
        yield
        return
    before = level.value
    level.value = max(before, C10_LOG_ERROR)
    try:
        yield
    finally:
        level.value = before


C10_LOG_ERROR = 2   # c10's severities: 0 info, 1 warning, 2 error, 3 fatal


@functools.cache
def _c10_log_level() -> Any:
    """libc10's minimum log level (FLAGS_caffe2_log_level, which TORCH_CPP_LOG_LEVEL sets at import)."""
    try:
        import ctypes

        import torch

        library = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so"))
        return ctypes.c_int.in_dll(library, "FLAGS_caffe2_log_level")
    except (OSError, ValueError):
        return None


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str):
        super().__init__("localhost", timeout=5.0)
        self._unix_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._unix_path)
