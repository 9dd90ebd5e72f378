"""A real OTLP/gRPC trace receiver, and a "black hole" endpoint, for tests.

``OtlpReceiver`` is the official ``TraceService`` (generated code from
opentelemetry-proto) served by grpcio on 127.0.0.1. It records every
``ExportTraceServiceRequest`` and answers success::

    with OtlpReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}
        ...
        spans = receiver.wait_for_spans(lambda spans: len(spans) >= 10, timeout=30)

``BlackHole`` listens on a loopback port and accepts TCP connections but
never reads or answers, so an exporter's connection succeeds and then waits
until its own deadline.
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Callable

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as it arrived, flattened with its resource attributes."""

    trace_id: str            # hex
    span_id: str             # hex
    parent_span_id: str      # hex, "" for a root span
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]


def _value(any_value) -> Any:
    kind = any_value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in any_value.kvlist_value.values}
    return getattr(any_value, kind)


def _attributes(key_values) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in key_values}


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: "OtlpReceiver"):
        self.receiver = receiver

    def Export(self, request, context):  # noqa: N802 - gRPC method name
        self.receiver._record(request)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """OTLP/gRPC TraceService on 127.0.0.1:<free port>; thread-safe recording."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._requests: list[Any] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def start(self) -> "OtlpReceiver":
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None).wait(5)

    def __enter__(self) -> "OtlpReceiver":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _record(self, request) -> None:
        with self._changed:
            self._requests.append(request)
            self._changed.notify_all()

    @property
    def requests(self) -> list[Any]:
        """The ExportTraceServiceRequest messages received so far."""
        with self._lock:
            return list(self._requests)

    def spans(self) -> list[ReceivedSpan]:
        out = []
        for request in self.requests:
            for resource_spans in request.resource_spans:
                resource = _attributes(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    for s in scope_spans.spans:
                        out.append(ReceivedSpan(
                            trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(), name=s.name,
                            start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                            attributes=_attributes(s.attributes), resource=resource))
        return out

    def wait_for_spans(self, predicate: Callable[[list[ReceivedSpan]], bool], timeout: float) -> list[ReceivedSpan]:
        """Wait until ``predicate(spans)`` holds; raise TimeoutError with what arrived."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans()
            if predicate(spans):
                return spans
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"spans did not arrive within {timeout}s; got {len(spans)}")
            with self._changed:
                self._changed.wait(min(remaining, 0.5))


class BlackHole:
    """Accepts TCP connections on 127.0.0.1:<free port> and never answers.

    Accepted sockets are held open (never read) until ``stop``, so the peer
    sees a live connection whose HTTP/2 handshake never completes.
    """

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="black-hole", daemon=True)

    @property
    def connections(self) -> int:
        return len(self._held)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            self._held.append(conn)

    def start(self) -> "BlackHole":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        for conn in self._held:
            conn.close()
        self._listener.close()

    def __enter__(self) -> "BlackHole":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def closed_port_endpoint() -> str:
    """An endpoint on 127.0.0.1 where nothing listens (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"
