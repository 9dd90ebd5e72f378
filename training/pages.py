"""A node exporter's ``/metrics`` page, as its readers take it: fetched, and parsed once.

Two readers besides Prometheus: ``rankscope top`` (``rankscope.console``) and
rank 0's TensorBoard / MLflow sink (``rankscope.sinks``). Both read the page
through this module, so that a series means one thing to every reader. A
node's page is mostly histogram buckets and other runs' series: a reader that
wants a few names of one run has only those lines parsed.
"""

from __future__ import annotations

import urllib.request
from typing import Iterable, NamedTuple

from prometheus_client.parser import text_string_to_metric_families


class Series(NamedTuple):
    """One sample of one series: the exposition's name (``_bucket``/``_sum``/``_count`` kept), labels, value."""

    name: str
    labels: dict[str, str]
    value: float


def fetch(url: str, timeout: float) -> str:
    """The page at ``url`` (raises ``OSError`` and ``urllib.error.URLError`` as urllib does)."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode(errors="replace")


def parse(text: str, names: Iterable[str] | None = None, run: str | None = None) -> list[Series]:
    """The samples of a page; only those named in ``names`` (sample names: ``x_sum`` for a
    histogram's sum) and of ``run``, when given. Raises ``ValueError`` on text that is not a
    Prometheus exposition."""
    if names is not None or run is not None:
        wanted = None if names is None else frozenset(names)
        needle = None if run is None else f'run="{escape_label(run)}"'
        text = "\n".join(line for line in text.splitlines()
                         if line[:1] != "#" and (needle is None or needle in line)
                         and (wanted is None or line.split("{", 1)[0].split(" ", 1)[0] in wanted)) + "\n"
    out = []
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if run is None or s.labels.get("run") == run:
                    out.append(Series(s.name, dict(s.labels), float(s.value)))
    except Exception as e:  # noqa: BLE001 - the parser raises several kinds on text that is not an exposition
        raise ValueError(f"not a Prometheus exposition ({e})") from None
    return out


def escape_label(value: str) -> str:
    """A label value as the text exposition writes it between quotes."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
