"""OpenTelemetry traces of sampled and anomalous steps (docs/tracing.md).

* ``api``: ``Tracing`` (off: the no-op every Monitor has without an endpoint), its
  configuration from the ``OTEL_*`` variables, and the training thread's side of an
  enabled tracer (a bounded hand-off that never blocks);
* ``span_process``: the rank's span process: records are pickled to a child
  process, which builds and exports the spans;
* ``otlp``: the span pipeline the child runs (the OpenTelemetry SDK, batched, every
  drop counted);
* ``records``: a traced step as the tracer takes it (``StepRecord``).
"""

from __future__ import annotations

import os
from typing import Callable, Mapping

from rankscope.identity import RankIdentity
from rankscope.tracing.api import Tracing, TracingConfig

__all__ = ["Tracing", "TracingConfig", "build_tracing"]


def build_tracing(identity: RankIdentity, on_error: Callable[[], None],
                  env: Mapping[str, str] | None = None) -> Tracing:
    """Tracing configured from the standard OTEL_* variables (see docs/tracing.md).

    Raises ``ConfigError`` naming the variable when a value is wrong.
    """
    env = os.environ if env is None else env
    config = TracingConfig.from_env(env)
    if config is None:
        return Tracing()
    # Imported here, not with the package: the span process runs ``python -m
    # rankscope.tracing.span_process``, which must not be imported before it runs as __main__.
    from rankscope.tracing.span_process import SpanProcessTracing

    return SpanProcessTracing(identity, config, on_error, env)
