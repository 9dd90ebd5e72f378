"""Every series ``rankscope report`` and ``rankscope top --prometheus`` ask Prometheus for exists:
a metric of the catalog, a series the shipped rules record, or ALERTS. The report's goodput once
asked for ``{__name__=~"rankscope_.*goodput.*"}``, which nothing is called (the goodput records are
``rank:`` and ``run:rankscope_goodput:ratio``), so its summary never showed one. The report runs
whole against a Prometheus stand-in that records each query. No processes."""

from __future__ import annotations

import re
import time

import pytest

from prometheus.rules_spec import RECORDING_RULES
from rankscope.console import report, top
from rankscope.console.sources import Series
from rankscope.contract.catalog import RANK_METRICS
from rankscope.exporter.catalog import EXPORTER_METRICS

NOW = time.time()
RUN = "r1"


def known_series() -> set[str]:
    names = {"ALERTS"} | {r.record for r in RECORDING_RULES}
    for m in (*RANK_METRICS, *EXPORTER_METRICS):
        names.add(m.name)
        if m.kind == "histogram":
            names |= {m.name + suffix for suffix in ("_bucket", "_sum", "_count")}
    return names


def series_read(expr: str) -> tuple[set[str], list[str]]:
    """(series names, ``__name__`` regexes) an expression reads."""
    regexes = re.findall(r'__name__=~"([^"]*)"', expr)
    without_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    names = set(re.findall(r"\b(?:rankscope_[a-z0-9_]+|[a-z_]+:rankscope_[a-z0-9_:]+|ALERTS)\b", without_strings))
    return names, regexes


class RecordingPrometheus:
    """Prometheus's API as the console calls it; every query recorded, each answered from ``answers``
    (the first pattern found in the expression), else empty."""

    queries: list[str] = []
    answers: dict[str, float] = {}

    def __init__(self, url: str, timeout: float = 30.0):
        self.url = url

    def check(self) -> None:
        pass

    def scrape_interval(self, default: float = 15.0) -> float:
        return 5.0

    def _value(self, expr: str) -> float | None:
        return next((v for pattern, v in self.answers.items() if pattern in expr), None)

    def query(self, expr: str, at: float | None = None) -> list[Series]:
        self.queries.append(expr)
        value = self._value(expr)
        return [] if value is None else [Series("", {"run": RUN, "rank": "0"}, value)]

    def query_range(self, expr, start, end, step):
        self.queries.append(expr)
        return []

    def label_values(self, label, match=None):
        return [RUN]

    def run_series(self, run, at=None):
        return self.query(f'{{__name__=~"rankscope_.+",run="{run}"}}', at)

    def firing_alerts(self, run, at=None):
        return self.query(f'ALERTS{{alertstate="firing",run="{run}"}}', at)


@pytest.fixture
def prometheus(monkeypatch):
    RecordingPrometheus.queries = []
    RecordingPrometheus.answers = {"rankscope_rank_start_timestamp_seconds": NOW - 600,
                                   "rankscope_heartbeat_timestamp_seconds": NOW - 60,
                                   'rankscope_wall_seconds_total{run="r1",category="productive"}': 0.8}
    monkeypatch.setattr(report, "Prometheus", RecordingPrometheus)
    return RecordingPrometheus


def _unknown(queries: list[str]) -> list[str]:
    known = known_series()
    out = []
    for expr in queries:
        names, regexes = series_read(expr)
        out += [f"{name} in {expr!r}" for name in sorted(names - known)]
        out += [f"__name__=~{rx!r} matches nothing, in {expr!r}" for rx in regexes
                if not any(re.fullmatch(rx, name) for name in known)]
    return out


def test_every_series_the_report_reads_exists_and_it_shows_goodput(prometheus, tmp_path):
    written = report.write_report("http://prometheus:9090", RUN, tmp_path / "r.html")
    assert len(prometheus.queries) > 20
    assert _unknown(prometheus.queries) == []
    assert written.facts["summary"]["goodput"] == 0.8
    assert "<th>goodput</th><td>0.8</td>" in (tmp_path / "r.html").read_text()


def test_the_scan_flags_the_old_goodput_query():
    assert _unknown(['{__name__=~"rankscope_.*goodput.*",run="r1"}'])
    assert _unknown(["rankscope_goodput_ratio"]) and not _unknown(["run:rankscope_goodput:ratio"])


def test_every_series_top_reads_from_prometheus_exists(monkeypatch):
    RecordingPrometheus.queries = []
    RecordingPrometheus.answers = {"rankscope_rank_state": 1.0}
    source = top.PrometheusSource(RecordingPrometheus("http://prometheus:9090"), RUN, 30.0)
    assert source.fetch().run == RUN
    assert len(RecordingPrometheus.queries) >= 4 and _unknown(RecordingPrometheus.queries) == []
