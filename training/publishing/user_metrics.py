"""The user's own metrics, exported per rank under the rank's identity labels.

    acc = monitor.gauge("eval_accuracy_ratio", "Held-out accuracy")
    acc.set(0.93)
    hits = monitor.counter("cache_hits_total", "Cache hits", labels=("tier",))
    hits.inc(tier="ram")

Everything that can be checked is checked at declaration and raises
``ConfigError``: names are ASCII lower_snake_case (``rankscope_user_`` is
prefixed), counters and only counters end in ``_total``, label names are
ASCII, distinct, and not reserved (identity labels, Prometheus's own, and
``pid``, which prometheus_client's multiprocess mode strips from gauges).
At use, a value or a label set that does not fit is a counted error
(``rankscope_telemetry_errors_total{component="user"}``), never an exception
in the loop.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Callable, Sequence, TypeAlias

from rankscope.contract import catalog
from rankscope.contract.catalog import MetricSpec
from rankscope.contract.environment import ConfigError
from rankscope.device.rank_device import RankDevice
from rankscope.errors import TelemetryErrors
from rankscope.publishing.metrics import RankMetrics

if TYPE_CHECKING:
    import torch
    from prometheus_client.metrics import MetricWrapperBase

Value: TypeAlias = "float | torch.Tensor"   # a number, or a one-element tensor (a CUDA one is read without a sync)

NAME = re.compile(r"[a-z][a-z0-9_]*\Z")
LABEL = re.compile(r"[a-z][a-z0-9_]*\Z")
RESERVED_LABELS = frozenset(catalog.IDENTITY_LABELS) | {"job", "instance", "step", "le", "quantile", "pid"}
MAX_CHILDREN = 1000   # label sets per metric: a label fed from data would otherwise grow without bound


class UserMetrics:
    def __init__(self, metrics: RankMetrics, errors: TelemetryErrors, device: RankDevice | None = None):
        self._metrics = metrics
        self._errors = errors
        self._device = device   # rankscope.device.RankDevice: a CUDA value is read once the device is done

    def declare(self, name: str, kind: str, documentation: str, labels: Sequence[str] = (),
                buckets: Sequence[float] | None = None) -> "UserMetric":
        labels = tuple(labels)
        _check_name(name, kind)
        _check_labels(name, labels)
        if not isinstance(documentation, str) or not documentation.strip():
            raise ConfigError(f"user metric {name!r}: give it a one-line description")
        spec = MetricSpec(catalog.USER_PREFIX + name, kind, documentation,  # type: ignore[arg-type]
                          gauge_mode="mostrecent", buckets=tuple(buckets) if buckets is not None else None)
        try:
            metric = self._metrics.declare(spec, labels)
        except ValueError as e:   # prometheus_client: a duplicate name, bad buckets
            raise ConfigError(f"user metric {name!r}: {e}") from None
        return UserMetric(self._metrics, self._errors, metric, labels, self._device)


def _check_name(name: str, kind: str) -> None:
    if not isinstance(name, str) or not NAME.match(name):
        raise ConfigError(f"user metric {name!r}: use ASCII lower_snake_case: a-z first, then a-z, 0-9 and _")
    if kind == "counter" and not name.endswith("_total"):
        raise ConfigError(f"user counter {name!r}: counter names end in _total")
    if kind != "counter" and name.endswith("_total"):
        raise ConfigError(f"user {kind} {name!r}: only counters end in _total")


def _check_labels(name: str, labels: tuple[str, ...]) -> None:
    for label in labels:
        if not isinstance(label, str) or not LABEL.match(label):
            raise ConfigError(f"user metric {name!r}: label {label!r} must be ASCII lower_snake_case")
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise ConfigError(f"user metric {name!r}: label(s) {', '.join(duplicates)} given twice")
    reserved = sorted(RESERVED_LABELS & set(labels))
    if reserved:
        raise ConfigError(f"user metric {name!r}: label(s) {', '.join(reserved)} are reserved")


class UserMetric:
    """A declared metric. Its methods never raise into the loop, and never wait for the device: a
    value may be a number or a one-element tensor; a CUDA one is copied without a sync and
    applied by the publisher once the device has finished it (rankscope.device.reads)."""

    def __init__(self, metrics: RankMetrics, errors: TelemetryErrors, metric: MetricWrapperBase,
                 labels: tuple[str, ...], device: RankDevice | None = None):
        self._metrics = metrics
        self._errors = errors
        self._metric = metric
        self._labels = labels
        self._device = device
        self._children: dict[tuple[str, ...], MetricWrapperBase] = {}
        if not labels:
            self._children[()] = metrics.child(metric, {})

    def _child(self, label_values: dict[str, object]) -> MetricWrapperBase:
        if label_values.keys() != set(self._labels):
            raise ValueError(f"labels {sorted(label_values)} given, {sorted(self._labels)} declared")
        key = tuple(str(label_values[k]) for k in self._labels)
        child = self._children.get(key)
        if child is None:
            if len(self._children) >= MAX_CHILDREN:
                raise ValueError(f"more than {MAX_CHILDREN} label sets")
            child = self._children[key] = self._metrics.child(self._metric, dict(zip(self._labels, key)))
        return child

    def _apply(self, method: str, value: Value, labels: dict[str, object]) -> None:
        try:
            apply = getattr(self._child(labels), method)
            device = self._device
            if device is not None and hasattr(value, "item") and device.device_of(value) is not None:
                self._defer(device, value, apply)
                return
            apply(float(value.item()) if hasattr(value, "item") else float(value))   # a CPU tensor, too
        except Exception:
            self._errors.error("user")

    def _defer(self, device: RankDevice, tensor: torch.Tensor, apply: Callable[[float], None]) -> None:
        if tensor.numel() != 1:
            raise ValueError(f"a tensor of {tensor.numel()} values: give one")
        if not device.cuda:
            device.bind(device.device_of(tensor))   # a Monitor() without a device learns it here too
        device.reads.defer_user_value("a user metric", tensor.detach().reshape(()), apply)

    def set(self, value: Value, **labels: object) -> None:
        self._apply("set", value, labels)

    def inc(self, amount: Value = 1.0, **labels: object) -> None:
        self._apply("inc", amount, labels)

    def observe(self, value: Value, **labels: object) -> None:
        self._apply("observe", value, labels)
