"""Where the console reads from: node exporters' ``/metrics``, or Prometheus's HTTP API.

Every failure to reach or understand a source is a ``SourceError`` whose
message is one line naming the URL and what went wrong; the CLI prints it and
exits 2 (a person at a terminal during an incident needs the cause, not a
traceback).
"""

from __future__ import annotations

import json
import math
import re
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from rankscope import pages
from rankscope.contract.environment import DEFAULT_ADDR, DEFAULT_PORT, ConfigError, env_value, metrics_url
from rankscope.contract.rundir import default_metrics_dir, exporter_address
from rankscope.pages import Series
from rankscope.pages.record import EVIDENCE_SERIES

DEFAULT_EXPORTER = f"http://{DEFAULT_ADDR}:{DEFAULT_PORT}/metrics"
# Labels Prometheus adds on scrape; two jobs scraping one exporter give the same rank series twice.
TARGET_LABELS = ("job", "instance")


class SourceError(Exception):
    """A source cannot be read or is not what it should be. The message is one line."""


def _get(url: str, timeout: float) -> bytes:
    try:
        return pages.get(url, timeout)
    except pages.FetchError as e:
        raise SourceError(str(e)) from None


def local_exporter_url(env: Mapping[str, str]) -> str:
    """This user's exporter on this node, where the ranks and the exporter put it:
    RANKSCOPE_METRICS_ADDR and RANKSCOPE_METRICS_PORT; else where the exporter of this user's
    metrics directory says it listens (another user's may hold 9400); else 127.0.0.1:9400."""
    try:
        port = env_value(env, "RANKSCOPE_METRICS_PORT", int, None)
        addr = env_value(env, "RANKSCOPE_METRICS_ADDR", str, DEFAULT_ADDR)
        directory = env_value(env, "RANKSCOPE_METRICS_DIR", str, None)
    except ConfigError as e:
        raise SourceError(str(e)) from None
    if port is None:
        recorded = exporter_address(Path(directory) if directory else default_metrics_dir())
        addr, port = recorded if recorded is not None else (addr, DEFAULT_PORT)
    return metrics_url(addr, port)


def exporter_url(text: str) -> str:
    """``host:port``, ``http://host:port`` or a full ``.../metrics`` URL, as the metrics URL."""
    try:
        return pages.page_url(text)
    except ValueError as e:
        raise SourceError(str(e)) from None


def scrape_exporter(url: str, timeout: float = 5.0) -> list[Series]:
    """Every sample a rankscope node exporter serves."""
    try:
        samples = pages.parse(pages.fetch(url, timeout))
    except pages.FetchError as e:
        raise SourceError(str(e)) from None
    except ValueError as e:
        raise SourceError(f"{url}: {e}") from None
    if not any(s.name == "rankscope_exporter_info" for s in samples):
        raise SourceError(f"{url}: not a rankscope exporter (no rankscope_exporter_info series)")
    return samples


@dataclass
class Prometheus:
    """The few calls of Prometheus's HTTP API the console needs."""

    url: str
    timeout: float = 30.0
    _checked: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if "://" not in self.url:
            self.url = "http://" + self.url
        self.url = self.url.rstrip("/")

    def api(self, path: str, **params: Any) -> Any:
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        raw = _get(f"{self.url}/api/v1/{path}" + (f"?{query}" if query else ""), self.timeout)
        try:
            body = json.loads(raw)
        except ValueError:
            raise SourceError(f"{self.url}: not a Prometheus server (no JSON at /api/v1/{path})") from None
        if not isinstance(body, dict) or body.get("status") != "success":
            error = body.get("error", body) if isinstance(body, dict) else body
            raise SourceError(f"{self.url}: Prometheus API error on {path}: {error}")
        return body["data"]

    def check(self) -> None:
        """Fail early, with one line, if the URL is not a Prometheus server."""
        if not self._checked:
            try:
                data = self.api("status/buildinfo")
            except SourceError as e:
                if "HTTP 404" not in str(e):
                    raise
                raise SourceError(f"{self.url}: not a Prometheus server (no /api/v1/status/buildinfo)") from None
            if not isinstance(data, dict) or "version" not in data:
                raise SourceError(f"{self.url}: not a Prometheus server (no build info)")
            self._checked = True

    def query(self, expr: str, at: float | None = None) -> list[Series]:
        """An instant query; every element of the vector as a Series (``__name__`` as name, if any)."""
        data = self.api("query", query=expr, time=None if at is None else f"{at:.3f}")
        if data.get("resultType") != "vector":
            raise SourceError(f"{self.url}: {expr!r} returned a {data.get('resultType')}, not a vector")
        out = []
        for item in data["result"]:
            labels = dict(item["metric"])
            out.append(Series(labels.pop("__name__", ""), labels, _number(item["value"][1])))
        return out

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[tuple[dict[str, str], list[tuple[float, float]]]]:
        data = self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step:g}")
        return [(dict(item["metric"]), [(float(t), _number(v)) for t, v in item["values"]]) for item in data["result"]]

    def label_values(self, label: str, match: str | None = None) -> list[str]:
        params = {"match[]": match} if match else {}
        return sorted(self.api(f"label/{label}/values", **params))

    def scrape_interval(self, default: float = 15.0) -> float:
        """The global scrape interval of the server's configuration (the rate windows' floor)."""
        try:
            config = yaml.safe_load(self.api("status/config")["yaml"]) or {}
            return parse_duration(str(config.get("global", {}).get("scrape_interval", ""))) or default
        except (SourceError, ValueError, KeyError, TypeError, yaml.YAMLError):
            return default

    def run_series(self, run: str, at: float | None = None) -> list[Series]:
        """Every rankscope series of a run at one instant, one per identity (target labels dropped)."""
        return dedupe(self.query(f'{{__name__=~"rankscope_.+",run="{escape(run)}"}}', at))

    def firing_alerts(self, run: str, at: float | None = None) -> list[Series]:
        return self.query(f'ALERTS{{alertstate="firing",run="{escape(run)}"}}', at)


def dedupe(samples: Iterable[Series]) -> list[Series]:
    """Drop the target labels and keep one sample per series (an evidence series keeps its
    ``instance``: the exporter that holds the capture)."""
    seen: dict[tuple, Series] = {}
    for s in samples:
        keep = ("instance",) if s.name == EVIDENCE_SERIES else ()
        labels = {k: v for k, v in s.labels.items() if k not in TARGET_LABELS or k in keep}
        seen.setdefault((s.name, tuple(sorted(labels.items()))), Series(s.name, labels, s.value))
    return list(seen.values())


def escape(value: str) -> str:
    """A label value inside a PromQL double-quoted string."""
    return value.replace("\\", "\\\\").replace('"', '\\"')


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0, "y": 31536000.0}


def parse_duration(text: str) -> float:
    """A Prometheus duration (``15s``, ``1m30s``, ``2h``) in seconds; 0 for an empty string."""
    text = text.strip()
    if not text:
        return 0.0
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w|y)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration: {text!r}")
    return sum(float(n) * _UNITS[u] for n, u in parts)
