"""rankscope.tracing.api on its own, without a receiver: configuration from the OTLP
variables, endpoint resolution, trace ids. Spans against real receivers and dead collectors,
and the span process: tests/integration/test_tracing_receivers.py; 2-rank torchrun jobs:
tests/integration/test_tracing.py."""

from __future__ import annotations

import hashlib

import pytest

from rankscope.config import ConfigError
from rankscope.identity import RankIdentity
from rankscope.tracing import build_tracing
from rankscope.tracing.api import Tracing, TracingConfig, step_trace_id


def identity(rank: int = 0, run: str = "unit-run", **kw) -> RankIdentity:
    return RankIdentity(run=run, rank=rank, local_rank=rank, world_size=2, local_world_size=2, node="node-a", **kw)


# -- configuration -------------------------------------------------------------------

def test_no_endpoint_means_tracing_off():
    tracing = build_tracing(identity(), lambda: None, env={})
    assert tracing.enabled is False
    assert type(tracing) is Tracing


@pytest.mark.parametrize("env", [
    {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"},
    {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"},
])
def test_disabled_by_standard_variables(env):
    assert build_tracing(identity(), lambda: None, env=env).enabled is False


@pytest.mark.parametrize("env, variable", [
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "not a url"}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "127.0.0.1:4317"}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:99999"}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "ftp://collector"}, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "RANKSCOPE_TRACE_EVERY": "0"}, "RANKSCOPE_TRACE_EVERY"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "RANKSCOPE_TRACE_EVERY": "ten"}, "RANKSCOPE_TRACE_EVERY"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
     "OTEL_EXPORTER_OTLP_PROTOCOL"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "RANKSCOPE_TRACE_EXPORT_TIMEOUT_S": "-1"},
     "RANKSCOPE_TRACE_EXPORT_TIMEOUT_S"),
])
def test_bad_configuration_is_a_config_error_naming_the_variable(env, variable):
    with pytest.raises(ConfigError, match=variable):
        build_tracing(identity(), lambda: None, env=env)


def test_endpoint_resolution_follows_the_otlp_spec():
    grpc = TracingConfig.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"})
    assert (grpc.protocol, grpc.endpoint) == ("grpc", "http://c:4317")
    http = TracingConfig.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/",
                                   "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    assert (http.protocol, http.endpoint) == ("http/protobuf", "http://c:4318/v1/traces")
    specific = TracingConfig.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                                       "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:9/custom",
                                       "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                                       "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    assert (specific.protocol, specific.endpoint) == ("http/protobuf", "http://t:9/custom")
    assert specific.every == 100 and specific.export_timeout_s == 1.0


# -- trace ids and sampling -------------------------------------------------------------

def test_trace_id_is_derived_from_run_and_step():
    expected = int.from_bytes(hashlib.sha256(b"run-a/42").digest()[:16], "big")
    assert step_trace_id("run-a", 42) == expected
    assert step_trace_id("run-a", 42) == step_trace_id("run-a", 42)
    ids = {step_trace_id("run-a", s) for s in range(1000)} | {step_trace_id("run-b", s) for s in range(1000)}
    assert len(ids) == 2000
    assert all(0 < i < 2**128 for i in ids)
