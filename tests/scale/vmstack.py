"""Debian's real VictoriaMetrics binaries on 127.0.0.1 for tests (package victoria-metrics 1.79).

    with VictoriaMetricsServer() as vm, \\
         VMAgent(scrape_config, remote_write=vm.write_url, members=2, member=0) as agent0, \\
         VMAlert(rule_files, datasource=vm.url, notifier=am.url) as alert:
        vm.query('up')

Each wraps one process started like promstack's servers (free loopback port,
private temp dir, ready on /-/ready, stopped by PID on exit). VictoriaMetrics
serves the Prometheus query API (/api/v1/query, query_range, label values),
so PrometheusServer's ``api``/``query`` are reused.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

import yaml

from tests.helpers.promstack import PrometheusServer, _Daemon

VICTORIA_METRICS_BIN = "victoria-metrics"
VMAGENT_BIN = "vmagent"
VMALERT_BIN = "vmalert"


class VictoriaMetricsServer(_Daemon):
    """Single-node VictoriaMetrics with temporary storage.

    ``-search.latencyOffset`` is cut from 30 s to 1 s: by default VictoriaMetrics
    hides the newest 30 s from queries (for late samples), which would delay
    every fast-drill alert by 30 s; production keeps the default.
    """

    name = "victoria-metrics"

    def __init__(self, extra_args: Iterable[str] = ()) -> None:
        super().__init__()
        self.extra_args = list(extra_args)

    def _command(self) -> list[str]:
        return [VICTORIA_METRICS_BIN, f"-storageDataPath={self.tmpdir / 'data'}",
                f"-httpListenAddr={self.address}", "-search.latencyOffset=1s", "-loggerLevel=WARN",
                *self.extra_args]

    @property
    def write_url(self) -> str:
        return self.url + "/api/v1/write"

    # The Prometheus-compatible query API, shared with PrometheusServer.
    api = PrometheusServer.api
    query = PrometheusServer.query


class VMAgent(_Daemon):
    """vmagent scraping with a Prometheus-style config and remote-writing to ``remote_write``.

    ``members``/``member``: -promscrape.cluster.membersCount / memberNum, so
    each member scrapes its share of the targets.
    """

    name = "vmagent"

    def __init__(self, config: dict | str, *, remote_write: str, members: int = 1, member: int = 0,
                 extra_args: Iterable[str] = ()) -> None:
        super().__init__()
        self.config_path = self.tmpdir / "scrape.yml"
        self.config_path.write_text(config if isinstance(config, str) else yaml.safe_dump(config, sort_keys=False))
        self.remote_write, self.members, self.member = remote_write, members, member
        self.extra_args = list(extra_args)

    def _command(self) -> list[str]:
        cluster = ([f"-promscrape.cluster.membersCount={self.members}",
                    f"-promscrape.cluster.memberNum={self.member}"] if self.members > 1 else [])
        return [VMAGENT_BIN, f"-promscrape.config={self.config_path}", f"-httpListenAddr={self.address}",
                f"-remoteWrite.url={self.remote_write}", f"-remoteWrite.tmpDataPath={self.tmpdir / 'queue'}",
                "-loggerLevel=WARN", *cluster, *self.extra_args]

    def active_targets(self) -> list[dict[str, Any]]:
        """The targets this member scrapes (its Prometheus-compatible /api/v1/targets)."""
        from tests.helpers.promstack import http_get_json
        return http_get_json(self.url + "/api/v1/targets")["data"]["activeTargets"]


class VMAlert(_Daemon):
    """vmalert evaluating ``rule_files`` against ``datasource``; ALERTS and recording
    results are written back through ``remote_write`` (and restored from ``remote_read``)."""

    name = "vmalert"

    def __init__(self, rule_files: Iterable[str | os.PathLike], *, datasource: str, notifier: str,
                 evaluation_interval: str = "15s", extra_args: Iterable[str] = ()) -> None:
        super().__init__()
        self.rule_files = [str(Path(p).resolve()) for p in rule_files]
        self.datasource, self.notifier, self.evaluation_interval = datasource, notifier, evaluation_interval
        self.extra_args = list(extra_args)

    def _command(self) -> list[str]:
        return [VMALERT_BIN, *(f"-rule={p}" for p in self.rule_files), f"-httpListenAddr={self.address}",
                f"-datasource.url={self.datasource}", f"-remoteWrite.url={self.datasource}",
                f"-remoteRead.url={self.datasource}", f"-notifier.url={self.notifier}",
                f"-evaluationInterval={self.evaluation_interval}", f"-external.url={self.url}",
                "-loggerLevel=WARN", *self.extra_args]
