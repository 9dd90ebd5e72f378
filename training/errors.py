"""Where rankscope's own failures and drops go: counted, logged once, never raised.

Telemetry must never stop training, and must never be silently wrong. So an
exception inside rankscope's code is counted in
``rankscope_telemetry_errors_total{component}``, and a value that rankscope
had to throw away (a buffer was full, a value could not be read, a value came
too late) in ``rankscope_telemetry_dropped_total{what}``. Each kind is logged
once per process, with the reason, so a user's mistake is visible in the log
without flooding it.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from rankscope.contract.catalog import DROP_REASONS, ERROR_COMPONENTS

log = logging.getLogger("rankscope")


class UsageError(RuntimeError):
    """The API was used in a way that cannot give right numbers (a nested step, say)."""


class TelemetryErrors:
    """Counts and logs errors and drops. Thread-safe: every thread reports here.

    The metrics are bound after construction (``bind``), because some parts
    that report here (tracing) must be built, and validated, before the
    metric files exist; what is reported before is counted once bound.
    """

    def __init__(self) -> None:
        self._metrics: Any = None
        self._early_errors: Counter[str] = Counter()
        self._early_drops: Counter[str] = Counter()
        self._logged: set[str] = set()

    def bind(self, metrics: Any) -> None:
        self._metrics = metrics
        for component, n in self._early_errors.items():
            metrics.errors[component].inc(n)
        for what, n in self._early_drops.items():
            metrics.drops[what].inc(n)

    def error(self, component: str) -> None:
        """Call from an ``except`` block: counts the error and logs its traceback once."""
        if component not in ERROR_COMPONENTS:
            component = "publisher"
        try:
            if self._metrics is None:
                self._early_errors[component] += 1
            else:
                self._metrics.errors[component].inc()
        except Exception:   # a full metrics filesystem: the log below still tells
            pass
        if component not in self._logged:
            self._logged.add(component)
            log.exception("rankscope: telemetry error in %s (training continues; logged once)", component)

    def drop(self, what: str, reason: str = "", n: int = 1) -> None:
        """Counts ``n`` values of kind ``what`` thrown away, and logs ``reason`` once per kind."""
        try:
            if self._metrics is None:
                self._early_drops[what] += n
            else:
                self._metrics.drops[what].inc(n)
        except Exception:
            pass
        key = "drop:" + what
        if key not in self._logged:
            self._logged.add(key)
            log.warning("rankscope: dropped %s (%s); counted in rankscope_telemetry_dropped_total{what=%r}, "
                        "logged once", DROP_REASONS.get(what, what), reason or "no detail", what)
