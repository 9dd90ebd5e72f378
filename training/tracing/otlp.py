"""The span pipeline itself: spans built after the fact from step records, batched and exported
over OTLP, every drop counted. It runs in the rank's span process
(rankscope.tracing.span_process), never in the rank: see rankscope.tracing.api for why each
piece is there.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Mapping, Sequence
from urllib.parse import urlsplit

from rankscope.holds import LongestHold
from rankscope.identity import RankIdentity
from rankscope.tracing.records import StepRecord
from rankscope.tracing.api import (ATTR_ANOMALY, ATTR_BUCKET, ATTR_BYTES, ATTR_LOSS, ATTR_OP, ATTR_PHASE, ATTR_RANK,
                                   ATTR_REASON, ATTR_SAMPLES, ATTR_STEP, ATTR_TOKENS, DEFAULT_SERVICE_NAME,
                                   EXPORT_CHUNK, RETRY_AFTER_S, ROOT_SPAN, QueuedTracing, TracingConfig, count_spans,
                                   resource_attributes, step_trace_id)

log = logging.getLogger("rankscope")


class OtlpTracing(QueuedTracing):
    def __init__(self, identity: RankIdentity, config: TracingConfig, on_error: Callable[[], None],
                 env: Mapping[str, str], resource: Mapping[str, str | int] | None = None):
        """``resource``: the rank's resource attributes, when this runs in another
        process than the rank's (rankscope.tracing.span_process): process.pid is the rank's."""
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

