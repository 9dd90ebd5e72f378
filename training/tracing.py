"""OpenTelemetry spans for sampled steps.

The monitor hands a finished ``StepRecord`` to ``Tracing.submit`` for steps
that are sampled (by step number, so every rank keeps the same steps) or
anomalous. Spans are built after the fact, with the recorded timestamps, off
the training thread. With no endpoint configured, tracing is off and costs a
single boolean test per step.

An enabled tracer runs in a child process of the rank (rankscope.span_process:
the rank only pickles each traced step's record onto a pipe, so building and
encoding spans never holds the rank's GIL). Data flow inside that process::

    reader (records from the rank)  span worker thread           BSP worker thread
    submit(record) ──► bounded record queue ──► build spans ──► BatchSpanProcessor
                       (full: drop, count)     (room check:      queue ──► exporter
                                                no room: drop,            (failures
                                                count)                    counted)

Why each piece:

* The rank only hands over a small ``StepRecord`` (floats, ints, short
  strings): no span objects, no SDK locks, no network.
* One worker thread builds every span, so the trace id of the step being
  emitted can be handed to the ``IdGenerator`` through a plain attribute: the
  trace id of a step is ``sha256(run/step)[:16]``, the same on every rank, so
  every rank's spans of one step form one trace.
* The SDK's ``BatchSpanProcessor`` drops silently (one deduplicated warning)
  when its queue is full. The worker therefore never offers it more spans than
  it has room for: spans handed over minus spans the exporter has been given
  is what the queue holds. Spans that do not fit are dropped and counted here.
* The SDK's own shutdown paths wait 30 s or more on a dead collector
  (docs/performance.md). The exporter gets a 1 s timeout, the
  provider is built with ``shutdown_on_exit=False`` and ``shutdown`` runs the
  SDK shutdown in a helper thread that is waited on for at most ``timeout_s``;
  after that deadline the exporter wrapper fails batches at once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence
from urllib.parse import urlsplit

from rankscope.contract.environment import ConfigError, env_value
from rankscope.holds import LongestHold
from rankscope.identity import RankIdentity
from rankscope.records import StepRecord

log = logging.getLogger("rankscope")

DEFAULT_SERVICE_NAME = "rankscope-training"
DEFAULT_TRACE_EVERY = 100
DEFAULT_EXPORT_TIMEOUT_S = 1.0
RETRY_AFTER_S = 5.0   # after a failed export, spans are dropped unbuilt this long before the next try
DEFAULT_BSP_QUEUE = 2048
# The SDK default is 5 s. Traced steps are rare, so exporting every second
# costs little, and spans spend less time in the queue, where they survive
# young collections and lengthen full ones (docs/performance.md, "Library costs").
DEFAULT_BSP_SCHEDULE_DELAY_MS = 1000
RECORD_QUEUE_SIZE = 128          # traced steps waiting for the span worker
PROTOCOLS = ("grpc", "http/protobuf")

# Attribute keys on spans (resource keys are set in ``resource_attributes``).
ATTR_STEP = "rankscope.step"
ATTR_RANK = "rankscope.rank"
ATTR_SAMPLES = "rankscope.samples"
ATTR_TOKENS = "rankscope.tokens"
ATTR_LOSS = "rankscope.loss"
ATTR_ANOMALY = "rankscope.anomaly"
ATTR_REASON = "rankscope.trace_reason"       # "sampled" or "anomaly"
ATTR_PHASE = "rankscope.phase"
ATTR_OP = "rankscope.collective.op"
ATTR_BYTES = "rankscope.collective.bytes"
ATTR_BUCKET = "rankscope.collective.bucket"
ROOT_SPAN = "train_step"


DEFAULT_BSP_EXPORT_BATCH = 512   # the SDK's default batch...
# ...sent EXPORT_CHUNK spans per request: encoding one span to protobuf takes ~35 us of Python
# on the batch processor's thread, holding the GIL the training thread may want back (64
# spans: ~2.2 ms, 8: ~0.4 ms); each request's network wait releases it (docs/performance.md, "GIL holds").
EXPORT_CHUNK = 8

class Tracing:
    """Tracing turned off: no spans, no threads, nothing held."""

    enabled = False

    def sampled(self, step: int) -> bool:
        return False

    def submit(self, record: StepRecord) -> None:
        pass

    def dropped(self) -> int:
        """Spans dropped or failed to export so far (cumulative)."""
        return 0

    def shutdown(self, timeout_s: float = 2.0) -> None:
        pass


# -- configuration -------------------------------------------------------------

@dataclass(frozen=True)
class TracingConfig:
    """What ``build_tracing`` read from the environment (validated)."""

    endpoint: str
    protocol: str                  # "grpc" or "http/protobuf"
    every: int                     # trace steps 0, every, 2*every, ...
    export_timeout_s: float
    bsp_queue: int                 # spans the batch processor may hold
    headers: dict[str, str] | None = None
    schedule_delay_ms: int = DEFAULT_BSP_SCHEDULE_DELAY_MS
    batch_size: int = DEFAULT_BSP_EXPORT_BATCH

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "TracingConfig | None":
        """None when tracing is off (no endpoint, SDK disabled, exporter none)."""
        if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return None
        exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
        if exporter == "none":
            return None
        if exporter not in ("", "otlp"):
            raise ConfigError(f"OTEL_TRACES_EXPORTER={exporter!r}: rankscope exports traces with 'otlp' "
                              "(or 'none' to turn tracing off)")
        every = _positive_int(env, "RANKSCOPE_TRACE_EVERY", DEFAULT_TRACE_EVERY)
        timeout = _positive_float(env, "RANKSCOPE_TRACE_EXPORT_TIMEOUT_S", DEFAULT_EXPORT_TIMEOUT_S)
        bsp_queue = _positive_int(env, "OTEL_BSP_MAX_QUEUE_SIZE", DEFAULT_BSP_QUEUE)
        delay_ms = _positive_int(env, "OTEL_BSP_SCHEDULE_DELAY", DEFAULT_BSP_SCHEDULE_DELAY_MS)
        batch_size = _positive_int(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", DEFAULT_BSP_EXPORT_BATCH)
        protocol_var = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" if env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                        else "OTEL_EXPORTER_OTLP_PROTOCOL")
        protocol = env.get(protocol_var, "").strip() or "grpc"
        if protocol not in PROTOCOLS:
            raise ConfigError(f"{protocol_var}={protocol!r} is not one of {', '.join(PROTOCOLS)}")
        endpoint_var, endpoint = _endpoint(env, protocol)
        if not endpoint:
            return None
        _check_url(endpoint_var, endpoint)
        return cls(endpoint, protocol, every, timeout, bsp_queue, _headers(env), delay_ms, batch_size)


def _endpoint(env: Mapping[str, str], protocol: str) -> tuple[str, str]:
    """The traces endpoint as the OTLP exporter spec defines it.

    The signal-specific variable is used as is; the generic one is a base URL
    to which http/protobuf appends ``/v1/traces`` (gRPC takes it as is).
    """
    specific = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if specific:
        return "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", specific
    generic = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    if generic and protocol == "http/protobuf":
        _check_url("OTEL_EXPORTER_OTLP_ENDPOINT", generic)
        generic = generic.rstrip("/") + "/v1/traces"
    return "OTEL_EXPORTER_OTLP_ENDPOINT", generic


def _headers(env: Mapping[str, str]) -> dict[str, str] | None:
    """OTEL_EXPORTER_OTLP_[TRACES_]HEADERS ("k=v,k2=v2", URL-encoded), or None."""
    from opentelemetry.util.re import parse_env_headers

    raw = env.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS") or env.get("OTEL_EXPORTER_OTLP_HEADERS")
    return parse_env_headers(raw, liberal=True) if raw else None


def _check_url(var: str, url: str) -> None:
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError on a bad port
    except ValueError as e:
        raise ConfigError(f"{var}={url!r} is not a valid URL: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{var}={url!r} is not a URL like http://host:4317 (scheme http or https, and a host)")
    del port


def _positive_int(env: Mapping[str, str], var: str, default: int) -> int:
    value = env_value(env, var, int, default)
    if value < 1:
        raise ConfigError(f"{var}={value!r} must be >= 1")
    return value


def _positive_float(env: Mapping[str, str], var: str, default: float) -> float:
    value = env_value(env, var, float, default)
    if not value > 0:
        raise ConfigError(f"{var}={value!r} must be > 0")
    return value


# -- identity of a trace ------------------------------------------------------------

def step_trace_id(run: str, step: int) -> int:
    """The trace id of one step of one run: the same on every rank."""
    trace_id = int.from_bytes(hashlib.sha256(f"{run}/{step}".encode()).digest()[:16], "big")
    return trace_id or 1  # all-zero is the invalid trace id


def resource_attributes(identity: RankIdentity, env: Mapping[str, str]) -> dict[str, str | int]:
    """Resource attributes of one rank (without service.name)."""
    attrs: dict[str, str | int] = {
        "service.instance.id": f"{identity.run}/{identity.rank}",
        "host.name": identity.node,
        "rankscope.run": identity.run,
        "rankscope.rank": identity.rank,
        "rankscope.local_rank": identity.local_rank,
        "rankscope.node": identity.node,
        "rankscope.world_size": identity.world_size,
        "rankscope.local_world_size": identity.local_world_size,
        "process.pid": os.getpid(),
    }
    if identity.k8s_pod:
        attrs["k8s.pod.name"] = identity.k8s_pod
        for var, key in (("POD_NAMESPACE", "k8s.namespace.name"), ("NODE_NAME", "k8s.node.name"),
                         ("POD_UID", "k8s.pod.uid")):
            if env.get(var):
                attrs[key] = env[var]
    if identity.slurm_job_id:
        attrs["slurm.job.id"] = identity.slurm_job_id
        for var, key in (("SLURM_JOB_NAME", "slurm.job.name"), ("SLURM_PROCID", "slurm.procid"),
                         ("SLURM_STEP_ID", "slurm.step.id"), ("SLURMD_NODENAME", "slurm.node.name")):
            if env.get(var):
                attrs[key] = env[var]
    return attrs


# -- the enabled tracer --------------------------------------------------------------

def build_tracing(identity: RankIdentity, on_error: Callable[[], None],
                  env: Mapping[str, str] | None = None) -> Tracing:
    """Tracing configured from the standard OTEL_* variables (see docs/tracing.md).

    Raises ``ConfigError`` naming the variable when a value is wrong.
    """
    env = os.environ if env is None else env
    config = TracingConfig.from_env(env)
    if config is None:
        return Tracing()
    from rankscope.span_process import SpanProcessTracing

    return SpanProcessTracing(identity, config, on_error, env)


def count_spans(record: StepRecord) -> int:
    return 1 + len(record.phases) + len(record.collectives)


class QueuedTracing(Tracing):
    """An enabled tracer's side on the training thread: the sampling test and a
    bounded hand-off of records that never blocks; what does not fit is dropped
    and counted. A consumer thread takes the records until the ``None`` marker."""

    enabled = True

    def __init__(self, every: int):
        self._every = every
        self._records: queue.Queue[StepRecord | None] = queue.Queue(RECORD_QUEUE_SIZE)
        self._dropped = 0       # spans of records never handed on (queue full, closing)
        self._closing = False

    def _accepting(self) -> bool:
        return not self._closing

    # -- training thread ------------------------------------------------------------
    def sampled(self, step: int) -> bool:
        return step % self._every == 0

    def submit(self, record: StepRecord) -> None:
        """O(1), never blocks: a full queue drops the record and counts its spans."""
        if not self._accepting():
            self._dropped += count_spans(record)
            return
        try:
            self._records.put_nowait(record)
        except queue.Full:
            self._dropped += count_spans(record)

    # -- shutdown -------------------------------------------------------------------
    def _close_queue(self) -> None:
        """No more records; the consumer stops at the marker, after what is queued."""
        self._closing = True
        try:
            self._records.put_nowait(None)
        except queue.Full:  # the consumer is behind: let it finish what fits before the deadline
            threading.Thread(target=self._records.put, args=(None,), daemon=True).start()

    def _drop_queued(self) -> None:
        """Counts the records the consumer will never take (the deadline passed)."""
        while True:
            try:
                record = self._records.get_nowait()
            except queue.Empty:
                return
            if record is not None:
                self._dropped += count_spans(record)


class OtlpTracing(QueuedTracing):
    def __init__(self, identity: RankIdentity, config: TracingConfig, on_error: Callable[[], None],
                 env: Mapping[str, str], resource: Mapping[str, str | int] | None = None):
        """``resource``: the rank's resource attributes, when this runs in another
        process than the rank's (rankscope.span_process): process.pid is the rank's."""
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.trace import set_span_in_context

        super().__init__(config.every)
        self.identity = identity
        self.config = config
        self._on_error = on_error
        self._set_span_in_context = set_span_in_context
        self._shut = False
        self._ids = StepIdGenerator()
        self.exporter = CountingExporter(_make_exporter(config))
        self.processor = RoomCheckedProcessor(self.exporter, config.bsp_queue, config.schedule_delay_ms,
                                              config.batch_size)
        # Resource.create reads OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME
        # from the process environment; the identity attributes win over them.
        name = env.get("OTEL_SERVICE_NAME") or Resource.create({}).attributes.get("service.name", "")
        if not name or str(name).startswith("unknown_service"):
            name = DEFAULT_SERVICE_NAME   # neither OTEL_SERVICE_NAME nor OTEL_RESOURCE_ATTRIBUTES named one
        attributes = resource_attributes(identity, env) if resource is None else dict(resource)
        resource = Resource.create({**attributes, "service.name": name})
        # shutdown_on_exit=False: the SDK's atexit handler waits up to 30 s on a
        # dead collector; ``shutdown`` below is bounded instead.
        self.provider = TracerProvider(resource=resource, id_generator=self._ids, shutdown_on_exit=False)
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer("rankscope")
        self.hold = LongestHold()   # the longest span-building stretch of the worker
        self._worker = threading.Thread(target=self._work, name="rankscope-spans", daemon=True)
        self._worker.start()

    def dropped(self) -> int:
        # After shutdown, a span still queued or in an unfinished export will
        # not be delivered (if that export fails later, its spans move from
        # "unfinished" to "failed": no double count).
        unfinished = self.processor.queued() + self.exporter.in_flight() if self._shut else 0
        return self._dropped + self.processor.dropped + self.exporter.failed + max(unfinished, 0)

    # -- span worker ------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            record = self._records.get()
            if record is None:
                return
            self.hold.start()
            try:
                self._emit(record)
            except Exception:
                self._on_error()
            self.hold.stop()

    def _emit(self, record: StepRecord) -> None:
        if self.exporter.collector_down() or not self.processor.has_room(count_spans(record)):
            self.processor.dropped += count_spans(record)
            return
        rank, step = self.identity.rank, record.step
        common = {ATTR_STEP: step, ATTR_RANK: rank}
        root_attrs: dict[str, str | int | float] = {
            **common, ATTR_SAMPLES: record.samples, ATTR_TOKENS: record.tokens,
            ATTR_REASON: "anomaly" if record.anomaly and not self.sampled(step) else "sampled",
        }
        if record.loss is not None:
            root_attrs[ATTR_LOSS] = float(record.loss)
        if record.anomaly:
            root_attrs[ATTR_ANOMALY] = record.anomaly
        self._ids.next_trace_id = step_trace_id(self.identity.run, step)
        root = self.tracer.start_span(ROOT_SPAN, attributes=root_attrs, start_time=_ns(record.start))
        self._ids.next_trace_id = None
        parent = self._set_span_in_context(root)
        for phase in record.phases:
            span = self.tracer.start_span(phase.name, context=parent, start_time=_ns(phase.start),
                                          attributes={**common, ATTR_PHASE: phase.name})
            span.end(end_time=_ns(phase.start + phase.duration))
        for c in record.collectives:
            span = self.tracer.start_span(c.op, context=parent, start_time=_ns(c.start),
                                          attributes={**common, ATTR_OP: c.op, ATTR_BYTES: c.nbytes,
                                                      ATTR_BUCKET: c.bucket})
            span.end(end_time=_ns(c.start + c.duration))
        root.end(end_time=_ns(record.start + record.duration))

    # -- shutdown -----------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Export what can be exported within ``timeout_s``; never waits longer.

        Spans still queued when the deadline passes are counted as dropped.
        """
        if self._closing:
            return
        deadline = time.monotonic() + timeout_s
        self._close_queue()
        self.exporter.deadline = deadline
        # Leave the last part of the budget for the SDK shutdown (export + close channel).
        self._worker.join(timeout=max(0.0, (deadline - time.monotonic()) * 0.5))
        closer = threading.Thread(target=self._close_sdk, name="rankscope-spans-shutdown", daemon=True)
        closer.start()
        # A collector that failed the last export is down: do not wait for an
        # export still in flight to it (a black hole holds it for the whole
        # export timeout); its spans are counted as dropped below.
        wait = deadline - time.monotonic() if self.exporter.last_ok else min(0.1, deadline - time.monotonic())
        closer.join(timeout=max(0.0, wait))
        self._shut = True   # from now on, spans still queued count as dropped
        self._drop_queued()

    def _close_sdk(self) -> None:
        try:
            self.provider.shutdown()
        except Exception:
            self._on_error()


class StepIdGenerator:
    """Trace ids chosen by the span worker (one per step), random span ids.

    Only the span worker thread creates spans, so a plain attribute carries
    the trace id of the root span being started. A root span started without
    one (nobody does) gets a random id.
    """

    def __init__(self) -> None:
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

        self._random = RandomIdGenerator()
        self.next_trace_id: int | None = None

    def generate_span_id(self) -> int:
        return self._random.generate_span_id()

    def generate_trace_id(self) -> int:
        if self.next_trace_id is not None:
            return self.next_trace_id
        return self._random.generate_trace_id()

    def is_trace_id_random(self) -> bool:
        return False  # derived from (run, step), not random


def _ns(unix_s: float) -> int:
    return int(unix_s * 1e9)


def _make_exporter(config: TracingConfig):
    """The OTLP span exporter. Compression and certificates come from the
    OTEL_EXPORTER_OTLP_* variables, read by the exporter itself."""
    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=config.endpoint, insecure=urlsplit(config.endpoint).scheme == "http",
                            timeout=config.export_timeout_s, headers=config.headers)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=config.endpoint, timeout=config.export_timeout_s, headers=config.headers)


class CountingExporter:
    """Wraps the OTLP exporter: counts the spans it is given and those that
    failed to export. Once shutdown has started (``deadline`` set), it fails
    batches at once if the deadline has passed or the previous export failed,
    instead of waiting on a dead collector again.

    Duck-typed (the SDK's batch processor only calls these three methods) so
    that importing this module does not import the SDK.
    """

    def __init__(self, inner):
        self.inner = inner
        self.given = 0
        self.succeeded = 0
        self.failed = 0
        self.deadline: float | None = None   # set when shutdown starts
        self.last_ok = True
        self.failed_at = 0.0                 # monotonic time of the last failed export
        self._logged = False
        self.hold = LongestHold()            # the longest export: serialising runs Python on the SDK's thread

    def export(self, spans: Sequence):
        from opentelemetry.sdk.trace.export import SpanExportResult

        n = len(spans)
        self.given += n
        if self.deadline is not None and (time.monotonic() >= self.deadline or not self.last_ok):
            # Shutting down: past the deadline, or the collector failed the
            # last export (it is down: waiting on it again only delays exit).
            self.failed += n
            return SpanExportResult.FAILURE
        if self.collector_down():
            self.failed += n
            return SpanExportResult.FAILURE
        result = SpanExportResult.SUCCESS
        for at in range(0, n, EXPORT_CHUNK):
            # Encoding runs Python on this thread (the GIL held); the request itself lets it go.
            self.hold.start()
            try:
                result = self.inner.export(spans[at:at + EXPORT_CHUNK])
            except Exception:
                result = SpanExportResult.FAILURE
            self.hold.stop()
            if result is not SpanExportResult.SUCCESS:
                break   # the batch failed as a whole: its spans are all counted below
        self.last_ok = result is SpanExportResult.SUCCESS
        if self.last_ok:
            self.succeeded += n
        else:
            self.failed += n
            self.failed_at = time.monotonic()
            if not self._logged:
                self._logged = True
                log.warning("rankscope: span export to the OTLP endpoint failed; failed spans are counted "
                            "in rankscope_spans_dropped_total (logged once)")
        return result

    def collector_down(self) -> bool:
        """The last export failed less than RETRY_AFTER_S ago: do not try (or build spans) again yet.

        Against a dead collector, every export attempt and every span built
        costs CPU that the training ranks share; one probe every few seconds
        is enough to notice that it came back."""
        return not self.last_ok and time.monotonic() - self.failed_at < RETRY_AFTER_S

    def in_flight(self) -> int:
        return self.given - self.succeeded - self.failed

    def shutdown(self, timeout_millis: float = 1000, **kwargs) -> None:
        self.inner.shutdown(timeout_millis=timeout_millis)

    def force_flush(self, timeout_millis: int = 1000) -> bool:
        return True


class RoomCheckedProcessor:
    """A BatchSpanProcessor that is never offered more spans than its queue holds.

    The queue holds the spans handed over (``on_end``) minus the spans its
    worker has passed to the exporter. The worker pops a batch just before
    exporting it, so the estimate can only be high: the SDK never drops a
    span silently. Duck-typed SpanProcessor (composition, not inheritance).
    """

    def __init__(self, exporter: CountingExporter, max_queue_size: int, schedule_delay_ms: int,
                 batch_size: int):
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self.exporter = exporter
        self.max_queue = max_queue_size
        self.batch = BatchSpanProcessor(exporter, max_queue_size=max_queue_size,
                                        schedule_delay_millis=schedule_delay_ms,
                                        max_export_batch_size=min(batch_size, max_queue_size))
        self.handed = 0
        self.dropped = 0

    def queued(self) -> int:
        return self.handed - self.exporter.given

    def has_room(self, spans: int) -> bool:
        return self.queued() + spans <= self.max_queue

    def on_start(self, span, parent_context=None) -> None:
        pass

    def _on_ending(self, span) -> None:
        pass

    def on_end(self, span) -> None:
        if not (span.context and span.context.trace_flags.sampled):
            return  # OTEL_TRACES_SAMPLER said no: not a drop
        self.handed += 1
        self.batch.on_end(span)

    def shutdown(self) -> None:
        self.batch.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.batch.force_flush(timeout_millis)

