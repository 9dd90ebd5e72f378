"""/metrics text, rendered from cached per-series prefixes.

prometheus_client's encoders (``generate_latest`` for the text format,
``openmetrics.exposition.generate_latest`` for OpenMetrics) format every
label of every sample on every scrape: about 8 µs per sample, most of a
scrape of a node with thousands of series. A series' text up to its value
(metric name, ``{``, escaped labels, ``}``, space) depends only on its name
and labels, so it is rendered once per output format, by the library's own
encoder (a one-sample family), and kept. A scrape appends value text to
those prefixes; the header of a family (``# HELP``/``# TYPE``) is kept the
same way. The bytes are identical to the library's (tests/unit/exporter/test_reader.py
compares them), because the library renders every piece.

Merged rank families (``rankscope.exporter.reader.MergedFamily``) bring their
series' labels ready to key the cache; other families (derived rank states,
NVML, the exporter's own) are keyed by their samples' labels. A family with
anything this path does not reproduce (timestamps, exemplars, native
histograms, text-format ``_created``/``_gsum``/``_gcount`` samples, which the
library moves into a family of their own) is rendered by the library.

``make_metrics_app`` is prometheus_client's ``make_wsgi_app`` with this
renderer behind the same content negotiation; any format or query it does
not handle (``name[]`` filters, other escapings it cannot key) goes to the
library's app.
"""

from __future__ import annotations

import functools
import gzip
from typing import Callable, Iterable
from urllib.parse import parse_qs

from prometheus_client.exposition import choose_encoder, generate_latest, gzip_accepted, make_wsgi_app
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from rankscope.exporter.reader import MergedFamily

_PROBE = "rankscope_exposition_probe"
_PREFIX_CACHE_MAX = 1 << 18


class _One(Collector):
    def __init__(self, metric: Metric):
        self.metric = metric

    def collect(self) -> Iterable[Metric]:
        return [self.metric]


class Format:
    """One output format (an encoder and its arguments): cached prefixes and headers."""

    def __init__(self, encoder: Callable[..., bytes], openmetrics_format: bool):
        self.encoder = encoder
        self.openmetrics = openmetrics_format
        self.trailer = "# EOF\n" if openmetrics_format else ""
        # The text format moves these samples of a family into a gauge family of their own.
        self.moved = () if openmetrics_format else ("_created", "_gsum", "_gcount")
        self._prefix: dict[tuple, str] = {}
        self._header: dict[tuple, str] = {}
        self._by_plan: dict[int, tuple[object, list[str] | None]] = {}

    def _render(self, metric: Metric) -> str:
        text = self.encoder(_One(metric)).decode("utf-8")
        if self.trailer:
            assert text.endswith(self.trailer)
            text = text[:-len(self.trailer)]
        return text

    def _make_prefix(self, name: str, labels: dict) -> str:
        probe = Metric(_PROBE, "", "unknown")
        probe.samples = [Sample(name, labels, 0.0)]
        line = self._render(probe).rstrip("\n").rsplit("\n", 1)[-1]
        if not line.endswith(" 0.0"):
            raise ValueError(f"unexpected sample line {line!r}")
        return line[:-3]

    def prefix(self, name: str, labels: dict, key: tuple) -> str:
        p = self._prefix.get(key)
        if p is None:
            if len(self._prefix) >= _PREFIX_CACHE_MAX:
                self._prefix.clear()
                self._by_plan.clear()
            p = self._prefix[key] = self._make_prefix(name, labels)
        return p

    def prefixes(self, fam) -> list[str] | None:
        """Prefixes of a merged family's series in plan order; None: render it with the library."""
        hit = self._by_plan.get(id(fam))
        if hit is not None and hit[0] is fam:
            return hit[1]
        out: list[str] | None = []
        moved = tuple(fam.name + suffix for suffix in self.moved)
        for s in fam.series:
            if s.name in moved:
                out = None
                break
            out.append(self.prefix(s.name, dict(s.labels), (s.name, s.labels)))
        if len(self._by_plan) > 4096:
            self._by_plan.clear()
        self._by_plan[id(fam)] = (fam, out)
        return out

    def header(self, metric: Metric) -> str:
        key = (metric.name, metric.type, metric.documentation, metric.unit)
        h = self._header.get(key)
        if h is None:
            if len(self._header) >= 4096:
                self._header.clear()
            h = self._header[key] = self._render(Metric(metric.name, metric.documentation, metric.type, metric.unit))
        return h

    def render_generic(self, metric: Metric, out: list[str]) -> None:
        moved = tuple(metric.name + suffix for suffix in self.moved)
        lines = []
        for s in metric.samples:
            if (s.timestamp is not None or s.exemplar is not None or s.native_histogram is not None
                    or s.value is None or s.name in moved):
                out.append(self._render(metric))
                return
            lines.append(f"{self.prefix(s.name, s.labels, (s.name, tuple(s.labels.items())))}"
                         f"{floatToGoString(s.value)}\n")
        out.append(self.header(metric))
        out.extend(lines)

    def render(self, registry: Collector) -> bytes:
        # One family per name: the ranks' families come once per run directory, and OpenMetrics
        # parsers reject a name whose samples are split ("Clashing name"). A later family of a
        # name joins the first one's lines, without its header.
        by_name: dict[str, list[str]] = {}
        for metric in registry.collect():
            lines: list[str] = []
            if not (isinstance(metric, MergedFamily) and metric.render(self, lines)):
                self.render_generic(metric, lines)
            first = by_name.get(metric.name)
            if first is None:
                by_name[metric.name] = lines
            elif lines and lines[0] == self.header(metric):
                first.extend(lines[1:])
            else:   # rendered whole by the library (its header inside): kept as it is
                first.extend(lines)
        out = [line for lines in by_name.values() for line in lines]
        out.append(self.trailer)
        return "".join(out).encode("utf-8")


class Renderer:
    """The formats met so far, by the encoder prometheus_client's negotiation chose."""

    def __init__(self):
        self._formats: dict[tuple, Format | None] = {}

    def format_for(self, encoder: Callable[..., bytes]) -> Format | None:
        key = _encoder_key(encoder)
        if key is None:
            return None
        fmt = self._formats.get(key)
        if fmt is None and key not in self._formats:
            fmt = self._formats[key] = Format(encoder, key[0] is openmetrics.generate_latest)
        return fmt

    def render(self, registry: Collector, encoder: Callable[..., bytes] = generate_latest) -> bytes:
        fmt = self.format_for(encoder)
        return fmt.render(registry) if fmt is not None else encoder(registry)


def _encoder_key(encoder: Callable[..., bytes]) -> tuple | None:
    """(encoder function, its keyword arguments) for the library's two text encoders; None for anything else."""
    if encoder is generate_latest or encoder is openmetrics.generate_latest:
        return (encoder, ())
    if (isinstance(encoder, functools.partial) and not encoder.args
            and encoder.func in (generate_latest, openmetrics.generate_latest)
            and all(isinstance(v, str) for v in encoder.keywords.values())):
        return (encoder.func, tuple(sorted(encoder.keywords.items())))
    return None


def make_metrics_app(registry: Collector, disable_compression: bool = False, renderer: Renderer | None = None):
    """prometheus_client's make_wsgi_app, rendering through ``Renderer`` where it can."""
    library_app = make_wsgi_app(registry, disable_compression)
    renderer = renderer or Renderer()

    def app(environ: dict, start_response):
        if environ.get("REQUEST_METHOD") != "GET" or environ.get("PATH_INFO") == "/favicon.ico":
            return library_app(environ, start_response)
        if "name[]" in parse_qs(environ.get("QUERY_STRING", "")):
            return library_app(environ, start_response)
        encoder, content_type = choose_encoder(environ.get("HTTP_ACCEPT"))
        fmt = renderer.format_for(encoder)
        if fmt is None:
            return library_app(environ, start_response)
        output = fmt.render(registry)
        headers = [("Content-Type", content_type)]
        if not disable_compression and gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING")):
            output = gzip.compress(output)
            headers.append(("Content-Encoding", "gzip"))
        start_response("200 OK", headers)
        return [output]

    return app
