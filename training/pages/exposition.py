"""A node exporter's ``/metrics`` page as text exposition: parsed once, and only what a reader wants.

A node's page is mostly histogram buckets and other runs' series: a reader that wants a few
names of one run has only those lines parsed.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

from prometheus_client.parser import text_string_to_metric_families


class Series(NamedTuple):
    """One sample of one series: the exposition's name (``_bucket``/``_sum``/``_count`` kept), labels, value."""

    name: str
    labels: dict[str, str]
    value: float


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
