"""HTTP serving: a small WSGI application on prometheus_client's threading server.

Routes: /metrics (Prometheus text or OpenMetrics, negotiated), /evidence (the
evidence captured of ranks that stopped making progress: an index in JSON, a
rank's capture as HTML or JSON; rankscope.exporter.evidence), /healthz (a
JSON document that also lets a starting job recognise its node's exporter),
and / (a landing page).

Hardening (docs/reliability.md and docs/security.md have the drills):

* Optional TLS, mutual TLS and basic auth from an exporter-toolkit web
  configuration file (``rankscope.exporter.webconfig``). Every path is protected.
* The TLS handshake runs in the connection's own thread, never in the accept
  loop, so a client that connects and says nothing cannot stall the server.
* Each connection must deliver its request line and headers within
  ``HEADER_DEADLINE_S`` in total (slowloris: a byte every few seconds never
  trips a per-read timeout); every read and write also has a timeout.
* At most ``MAX_CONNECTIONS`` connections are served at once; beyond that a
  new connection is closed at once instead of growing threads without bound.
* Concurrent scrapes share one collection: a scrape waits for the collection
  in progress only if that one started after it arrived, else it starts one.
  Values are thus never older than the scrape's arrival, and 50 scrapers cost
  about one collection each round instead of 50.
* Errors in a connection (bad bytes, failed handshakes, resets) are logged at
  debug level, never as a traceback per connection on stderr.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import threading
import time
import urllib.parse
from typing import TYPE_CHECKING, Any, Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import ThreadingWSGIServer

from rankscope.exporter import __version__
from rankscope.exporter.evidence import EvidenceKeeper, flight_recorder_dumps, render_html
from rankscope.exporter.config import ExporterConfig
from rankscope.exporter.exposition import make_metrics_app
from rankscope.exporter.webconfig import WebConfig

if TYPE_CHECKING:
    import ssl

log = logging.getLogger("rankscope.exporter")

StartResponse = Callable[..., object]
RAW_PATH = "rankscope.raw_path"   # the request's path before percent-decoding (_Handler.get_environ)

SOCKET_TIMEOUT_S = 10.0      # any single read or write
HEADER_DEADLINE_S = 10.0     # request line + headers, in total
MAX_CONNECTIONS = 512
METRICS_CACHE_KEYS = 16      # distinct (Accept, Accept-Encoding, query) renderings kept


class _Handler(WSGIRequestHandler):
    """No access log per scrape; TLS handshake and header deadline per connection."""

    timeout = SOCKET_TIMEOUT_S
    # http.server answers a request line without a version as HTTP/0.9: a bare
    # body, no status line, which no scraper can read. Errors get a status
    # line instead, and such requests are refused (parse_request).
    default_request_version = "HTTP/1.0"

    def handle(self) -> None:
        self._deadline = threading.Timer(self.server.header_deadline_s, self._abort)
        self._deadline.daemon = True
        self._deadline.start()
        try:
            if self.server.ssl_context is not None:
                self.connection.do_handshake()
            super().handle()
        finally:
            self._deadline.cancel()

    def parse_request(self) -> bool:
        # The request line is in; the base class reads the headers here.
        if len(str(self.raw_requestline, "iso-8859-1").split()) == 2:
            self._deadline.cancel()
            self.request_version = self.default_request_version
            self.close_connection = True
            self.send_error(400, "HTTP/0.9 requests are not supported")
            return False
        ok = super().parse_request()
        self._deadline.cancel()   # headers are in: the deadline has done its job
        return ok

    def _abort(self) -> None:
        # The plain socket's shutdown, not SSLSocket's (which would drop the
        # SSL object under the reading thread): the blocked read sees EOF.
        try:
            socket.socket.shutdown(self.connection, socket.SHUT_RDWR)
        except OSError:
            pass

    def log_message(self, format: str, *args: object) -> None:
        pass

    def get_environ(self) -> dict:
        # PATH_INFO arrives percent-decoded (as Latin-1): a %2F in a run id would split the
        # path. The path as sent lets /evidence decode each segment on its own (RAW_PATH).
        env = super().get_environ()
        env[RAW_PATH] = self.path.split("?", 1)[0]
        return env


class ExporterServer(ThreadingWSGIServer):
    """Thread per connection, bounded; optional TLS."""

    daemon_threads = True
    request_queue_size = 128
    header_deadline_s = HEADER_DEADLINE_S

    def __init__(self, address: tuple[str, int], handler_class: type, ssl_context: ssl.SSLContext | None = None):
        self.ssl_context = ssl_context   # set before the socket binds: built whole, never wired after
        super().__init__(address, handler_class)

    def server_activate(self) -> None:
        super().server_activate()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def get_request(self):
        sock, addr = self.socket.accept()
        if self.ssl_context is not None:
            sock = self.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            log.debug("connection from %s refused: %d connections open", client_address, MAX_CONNECTIONS)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address) -> None:
        log.debug("connection from %s failed", client_address, exc_info=True)


class _SharedCollection:
    """Single-flight rendering of /metrics (see the module docstring)."""

    def __init__(self, metrics_app, lock: threading.Lock | None = None):
        self.metrics_app = metrics_app
        self.lock = lock if lock is not None else threading.Lock()
        self.cache: dict[tuple, tuple[float, str, list, list[bytes]]] = {}

    def __call__(self, environ: dict, start_response: StartResponse) -> Iterable[bytes]:
        arrived = time.monotonic()
        key = (environ.get("HTTP_ACCEPT", ""), environ.get("HTTP_ACCEPT_ENCODING", ""),
               environ.get("QUERY_STRING", ""))
        with self.lock:
            hit = self.cache.get(key)
            if hit is None or hit[0] < arrived:
                started = time.monotonic()
                captured: list = []
                body = list(self.metrics_app(environ, lambda status, headers, *a: captured.extend((status, headers))))
                hit = (started, captured[0], captured[1], body)
                if len(self.cache) >= METRICS_CACHE_KEYS:
                    self.cache.clear()
                self.cache[key] = hit
        _, status, headers, body = hit
        start_response(status, list(headers))
        return body


def make_app(cfg: ExporterConfig, registry: CollectorRegistry, lock: threading.Lock | None = None,
             web: WebConfig | None = None, evidence: EvidenceKeeper | None = None):
    started = {"pid": os.getpid(), "service": "rankscope-exporter", "version": __version__,
               "directory": str(cfg.directory), "node": cfg.node, "uid": os.getuid()}
    # prometheus_client's make_wsgi_app, rendering from cached series prefixes (exposition.py).
    metrics = _SharedCollection(make_metrics_app(registry), lock)
    web = web or WebConfig()

    def app(environ: dict, start_response: StartResponse) -> Iterable[bytes]:
        def respond(status: str, headers: list, *args):
            return start_response(status, list(headers) + web.headers, *args)

        if web.auth_required and not web.check_authorization(environ.get("HTTP_AUTHORIZATION")):
            body = b"Unauthorized\n"
            respond("401 Unauthorized", [("Content-Type", "text/plain"), ("Content-Length", str(len(body))),
                                         ("WWW-Authenticate", 'Basic realm="rankscope-exporter"')])
            return [body]
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            return metrics(environ, respond)
        if path == "/evidence" or path.startswith("/evidence/"):
            return _evidence(evidence, _segments(environ), environ.get("QUERY_STRING", ""), respond)
        if path in ("/healthz", "/-/healthy", "/-/ready"):
            body = json.dumps(started).encode()
            respond("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        if path == "/":
            body = (b"<html><head><title>rankscope exporter</title></head><body><h1>rankscope exporter</h1>"
                    b"<p><a href='/metrics'>/metrics</a> <a href='/evidence'>/evidence</a> "
                    b"<a href='/healthz'>/healthz</a></p></body></html>")
            respond("200 OK", [("Content-Type", "text/html"), ("Content-Length", str(len(body)))])
            return [body]
        respond("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found\n"]

    return app


def _segments(environ: dict) -> list[str]:
    """The path's segments after /evidence, each percent-decoded once: from the path as the client
    sent it where the server kept it (RAW_PATH), else from PATH_INFO (decoded by the server)."""
    raw = environ.get(RAW_PATH)
    if raw is not None and urllib.parse.unquote(raw).startswith("/evidence"):
        return [urllib.parse.unquote(p) for p in raw.split("/") if p][1:]
    return [p for p in environ.get("PATH_INFO", "/").split("/") if p][1:]


def _evidence(keeper: EvidenceKeeper | None, parts: list[str], query: str, respond) -> list[bytes]:
    """/evidence: the captures kept (JSON); /evidence/<run>/<rank>: a rank's newest capture,
    HTML for a person, JSON with ?format=json (&episode=N for an earlier one);
    /evidence/<run>/<rank>/flight-recorder/<name>: one of its flight-recorder dumps.
    <run>: the run's directory name (what the captures' links use) or the run id, URL-quoted
    or as is (a run id ``10.0.0.1:29500`` is neither its directory's name nor safe in a URL)."""
    params = urllib.parse.parse_qs(query)
    if keeper is None:
        return _plain(respond, "404 Not Found", b"evidence capture is off (--no-evidence)\n")
    if not parts:
        index = [{k: c.get(k) for k in ("run", "run_dir", "rank", "node", "episode", "trigger", "captured_at", "path")}
                 for c in keeper.captures()]
        return _json(respond, index)
    run_dir_name = keeper.run_dir_name(parts[0])
    if run_dir_name is None:
        return _plain(respond, "404 Not Found", b"no such run (a run id or its directory name, URL-quoted)\n")
    parts = [run_dir_name] + parts[1:]
    if len(parts) == 4 and parts[1].isdigit() and parts[2] == "flight-recorder":
        dump = keeper.dump(parts[0], int(parts[1]), parts[3])
        if dump is None:
            return _plain(respond, "404 Not Found", b"no such flight-recorder dump\n")
        body = dump.read_bytes()
        respond("200 OK", [("Content-Type", "application/octet-stream"), ("Content-Length", str(len(body))),
                           ("Content-Disposition", f'attachment; filename="{dump.name}"')])
        return [body]
    if len(parts) != 2 or not parts[1].isdigit():
        return _plain(respond, "404 Not Found", b"not found: /evidence/<run directory>/<rank>\n")
    episode = params.get("episode", [None])[0]
    capture = keeper.find(parts[0], int(parts[1]), int(episode) if episode and episode.isdigit() else None)
    if capture is None:
        return _plain(respond, "404 Not Found", b"no evidence of that rank\n")
    run_dir = keeper.cfg.directory / parts[0]   # the dumps written since the capture too
    capture["collectives"]["flight_recorder"] = [p.name for p in flight_recorder_dumps(run_dir, int(parts[1]))]
    if params.get("format", [""])[0] == "json":
        return _json(respond, capture)
    body = render_html(capture).encode()
    respond("200 OK", [("Content-Type", "text/html; charset=utf-8"), ("Content-Length", str(len(body)))])
    return [body]


def _json(respond, doc: Any) -> list[bytes]:
    body = json.dumps(doc).encode()
    respond("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
    return [body]


def _plain(respond, status: str, body: bytes) -> list[bytes]:
    respond(status, [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]


def serve(cfg: ExporterConfig, app, web: WebConfig | None = None) -> ExporterServer:
    """Bind (errors surface here, at start-up) and return the server; the caller runs it."""
    tls = web.ssl_context if web is not None else None
    return make_server(cfg.addr, cfg.port, app, functools.partial(ExporterServer, ssl_context=tls),
                       handler_class=_Handler)
