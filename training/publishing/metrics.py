"""The rank's metric objects, built from the catalog and bound to its identity.

prometheus_client decides between in-process and mmap-file values through the
module-level ``values.ValueClass``, chosen once at import from
PROMETHEUS_MULTIPROC_DIR. Rather than depend on import order (a user may
import prometheus_client long before us), rankscope builds its own
mmap-backed value class for its directory and installs it only while its own
metric children are created. The user's own prometheus_client metrics, if any,
are left exactly as they were.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, values

from rankscope.contract import catalog
from rankscope.contract.catalog import MetricSpec
from rankscope.contract.environment import ConfigError
from rankscope.publishing.mmapfile import ReservedMmapedDict
from rankscope.step.observed import OBSERVED_VALUES

_value_classes: dict[Path, type] = {}
_lock = threading.RLock()  # re-entrant: children may be created while creating others


@contextlib.contextmanager
def mmap_values(directory: Path) -> Iterator[None]:
    """Create prometheus_client values as mmap files in ``directory``."""
    with _lock:
        value_class = _value_classes.get(directory)
        previous = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if value_class is None:
            ours = {str(d) for d in _value_classes}
            if previous and previous not in ours and Path(previous).resolve() != directory.resolve():
                raise ConfigError(
                    f"PROMETHEUS_MULTIPROC_DIR={previous} is set to another directory; rankscope writes to "
                    f"{directory}. Unset it, or set RANKSCOPE_METRICS_DIR to the same directory."
                )
            value_class = _value_classes[directory] = values.MultiProcessValue()
        # The value class reads this variable when it opens a file (and again
        # after a fork), so it stays set, to the directory last used.
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
        # Files opened (and grown) here reserve their space first: on a full
        # tmpfs a sparse mmap page would otherwise kill the rank with SIGBUS.
        saved = values.ValueClass, values.MmapedDict
        values.ValueClass, values.MmapedDict = value_class, ReservedMmapedDict
        try:
            yield
        finally:
            values.ValueClass, values.MmapedDict = saved


def build_metric(spec: MetricSpec, registry: CollectorRegistry, extra_labels: tuple[str, ...] = ()):
    labels = spec.label_names + extra_labels
    if spec.kind == "counter":
        return Counter(spec.name, spec.help, labels, registry=registry)
    if spec.kind == "gauge":
        return Gauge(spec.name, spec.help, labels, registry=registry, multiprocess_mode=spec.gauge_mode)
    if spec.kind == "histogram":
        return Histogram(spec.name, spec.help, labels, registry=registry, buckets=spec.buckets)
    raise ValueError(f"unknown metric kind {spec.kind!r}")


@dataclass(slots=True)
class CollectiveSeries:
    duration: Any    # histogram child
    last: Any        # gauge child
    bytes: Any       # counter child
    bus_bytes: Any   # counter child
    in_flight: Any   # gauge child
    started: Any     # gauge child


class RankMetrics:
    """Pre-bound children of every catalog metric for one rank.

    Binding happens once at start-up: a ``labels()`` lookup costs about a
    microsecond, too much to pay per step for every metric.
    """

    def __init__(self, directory: Path, identity_labels: dict[str, str]):
        self.directory = directory
        self.identity = identity_labels
        self.registry = CollectorRegistry(auto_describe=False)
        self._metrics = {}
        with mmap_values(directory):
            for spec in catalog.RANK_METRICS + catalog.FENCE_METRICS:
                self._metrics[spec.name] = build_metric(spec, self.registry)
            ident = tuple(identity_labels[name] for name in catalog.IDENTITY_LABELS)
            m = self._metrics
            b = self.bind
            self.start_ts = b("rankscope_rank_start_timestamp_seconds")
            self.launch_world_size = b("rankscope_launch_world_size")
            self.startup_phase = {p: m["rankscope_startup_phase"].labels(*ident, p) for p in catalog.STARTUP_PHASES}
            self.startup_since = b("rankscope_startup_phase_since_timestamp_seconds")
            self.block_started = {k: m["rankscope_block_started_timestamp_seconds"].labels(*ident, k)
                                  for k in catalog.BLOCKS}
            self.block_ended = b("rankscope_block_ended_timestamp_seconds")
            self.heartbeat = b("rankscope_heartbeat_timestamp_seconds")
            # Around a step's values (publisher.write_step_values; rankscope.exporter.reader)
            self.values_fence_end = b(catalog.VALUES_FENCE_END)
            self.step = b("rankscope_step")
            self.steps = b("rankscope_steps_total")
            self.step_duration = b("rankscope_step_duration_seconds")
            self.step_last = b("rankscope_step_last_duration_seconds")
            self.step_last_compute = b("rankscope_step_last_compute_seconds")
            self.step_ts = b("rankscope_last_step_timestamp_seconds")
            self.phase = {p: m["rankscope_phase_seconds_total"].labels(*ident, p) for p in catalog.PHASES}
            self.samples = b("rankscope_samples_total")
            self.tokens = b("rankscope_tokens_total")
            self.wall = {c: m["rankscope_wall_seconds_total"].labels(*ident, c) for c in catalog.GOODPUT_CATEGORIES}
            for child in self.wall.values():
                child.inc(0)
            self.data_wait = b("rankscope_data_wait_seconds")
            # Bound only when known (bind_flops): a CPU job has no MFU, not an MFU of 0.
            self.model_flops = None
            self.peak_flops = None
            self.observed = {v.name: b(v.metric) for v in OBSERVED_VALUES}   # each one's last reading
            self.loss_ema = b("rankscope_loss_ema")
            self.loss_z = b("rankscope_loss_zscore")
            self.values_fence_begin = b(catalog.VALUES_FENCE_BEGIN)
            self.values_written = 0
            self.nonfinite = {w: m["rankscope_nonfinite_total"].labels(*ident, w) for w in catalog.NONFINITE_WHAT}
            self.loss_spikes = b("rankscope_loss_spikes_total")
            self.grad_spikes = b("rankscope_grad_norm_spikes_total")
            self.mem_allocated = b("rankscope_device_memory_allocated_bytes")
            self.mem_reserved = b("rankscope_device_memory_reserved_bytes")
            self.mem_peak = b("rankscope_device_memory_peak_allocated_bytes")
            self.mem_total = b("rankscope_device_memory_total_bytes")
            self.alloc_retries = b("rankscope_alloc_retries_total")
            self.ooms = b("rankscope_oom_total")
            self.rss = b("rankscope_host_memory_rss_bytes")
            self.mem_limit = b("rankscope_host_memory_limit_bytes")
            self.spans_dropped = b("rankscope_spans_dropped_total")
            self._ident = ident
            self._collectives: dict[str, CollectiveSeries] = {}
            for op in catalog.EAGER_COLLECTIVE_OPS:
                self.collective(op)
            # Bound up front, at 0: the first error or drop is then an increase that rate() sees.
            self.errors = {c: m["rankscope_telemetry_errors_total"].labels(*ident, c)
                           for c in catalog.ERROR_COMPONENTS}
            self.drops = {w: m["rankscope_telemetry_dropped_total"].labels(*ident, w) for w in catalog.DROP_REASONS}
            for child in (*self.errors.values(), *self.drops.values()):
                child.inc(0)

    def collective(self, op: str) -> CollectiveSeries:
        """The series of one collective op, bound on first use.

        Binding all eight ops up front would put 22 series per op per rank on
        every scrape, 154 of them for ops a DDP job never calls: they made up
        60% of the exporter's work (docs/performance.md)."""
        series = self._collectives.get(op)
        if series is not None:
            return series
        with mmap_values(self.directory):   # holds the module lock: two threads bind once
            series = self._collectives.get(op)
            if series is None:
                m, ident = self._metrics, self._ident
                series = CollectiveSeries(
                    duration=m["rankscope_collective_duration_seconds"].labels(*ident, op),
                    last=m["rankscope_collective_last_duration_seconds"].labels(*ident, op),
                    bytes=m["rankscope_collective_bytes_total"].labels(*ident, op),
                    bus_bytes=m["rankscope_collective_bus_bytes_total"].labels(*ident, op),
                    in_flight=m["rankscope_collective_in_flight"].labels(*ident, op),
                    started=m["rankscope_collective_started_timestamp_seconds"].labels(*ident, op),
                )
                series.in_flight.set(0.0)   # a bound op is exported as 0, not absent
                series.started.set(0.0)
                self._collectives[op] = series
        return series

    def bind(self, name: str):
        return self._metrics[name].labels(**self.identity)

    def bind_flops(self, counts_flops: bool) -> None:
        """The MFU's numerator: model FLOPs, if a figure was given."""
        if counts_flops:
            with mmap_values(self.directory):
                self.model_flops = self.bind("rankscope_model_flops_total")
                self.model_flops.inc(0)

    def bind_peak_flops(self, peak: float | None) -> None:
        """The MFU's denominator: the device's peak, once the device is known and if its peak is."""
        if peak is not None:
            with mmap_values(self.directory):
                self.peak_flops = self.bind("rankscope_device_peak_flops")
                self.peak_flops.set(peak)

    def set_rank_info(self, info: dict[str, str]) -> None:
        with mmap_values(self.directory):
            self._metrics["rankscope_rank_info"].labels(**self.identity, **info).set(1)

    def set_layout(self, labels: dict[str, str], previous: dict[str, str] | None) -> None:
        """The rank's layout series; one it had before is set to 0 (a multiprocess file keeps it)."""
        with mmap_values(self.directory):
            family = self._metrics["rankscope_rank_layout_info"]
            if previous is not None:
                family.labels(**self.identity, **previous).set(0)
            family.labels(**self.identity, **labels).set(1)

    def declare(self, spec: MetricSpec, extra_labels: tuple[str, ...]):
        """A user metric with the rank's identity labels (see rankscope.publishing.user_metrics)."""
        with mmap_values(self.directory):
            return build_metric(spec, self.registry, extra_labels)

    def family(self, name: str):
        """The prometheus_client metric of a catalog name (bind its children with ``child``)."""
        return self._metrics[name]

    def child(self, metric, labels: dict[str, str]):
        with mmap_values(self.directory):
            return metric.labels(**self.identity, **labels)
