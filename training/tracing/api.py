"""OpenTelemetry spans for sampled steps: the tracer's interface, its configuration, and the
training thread's side of an enabled tracer.

The monitor hands a finished ``StepRecord`` to ``Tracing.submit`` for steps
that are sampled (by step number, so every rank keeps the same steps) or
anomalous. Spans are built after the fact, with the recorded timestamps, off
the training thread. With no endpoint configured, tracing is off and costs a
single boolean test per step.

An enabled tracer runs in a child process of the rank (rankscope.tracing.span_process:
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
from dataclasses import dataclass
from typing import Mapping
from urllib.parse import urlsplit

from rankscope.contract.environment import ConfigError, env_value
from rankscope.identity import RankIdentity
from rankscope.tracing.records import StepRecord

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
