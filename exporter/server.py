"""HTTP serving: a small WSGI application on prometheus_client's threading server.

Routes: /metrics (Prometheus text or OpenMetrics, negotiated), /healthz (a
JSON document that also lets a starting job recognise its node's exporter),
and / (a landing page).
"""

from __future__ import annotations

import json
import os
import threading
from typing import Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from exporter import __version__
from exporter.config import ExporterConfig

StartResponse = Callable[..., object]


class _QuietHandler(WSGIRequestHandler):
    """No access log per scrape; short socket timeout so slow clients cannot pin threads."""

    timeout = 10

    def log_message(self, format: str, *args: object) -> None:
        pass


def make_app(cfg: ExporterConfig, registry: CollectorRegistry, lock: threading.Lock):
    started = {"pid": os.getpid(), "service": "rankscope-exporter", "version": __version__,
               "directory": str(cfg.directory), "node": cfg.node}

    metrics_app = make_wsgi_app(registry)

    def app(environ: dict, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            # One scrape at a time: concurrent merges of the same files would
            # only multiply the work.
            with lock:
                return list(metrics_app(environ, start_response))
        if path in ("/healthz", "/-/healthy", "/-/ready"):
            body = json.dumps(started).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        if path == "/":
            body = (b"<html><head><title>rankscope exporter</title></head><body><h1>rankscope exporter</h1>"
                    b"<p><a href='/metrics'>/metrics</a> <a href='/healthz'>/healthz</a></p></body></html>")
            start_response("200 OK", [("Content-Type", "text/html"), ("Content-Length", str(len(body)))])
            return [body]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found\n"]

    return app


def serve(cfg: ExporterConfig, app) -> ThreadingWSGIServer:
    """Bind (errors surface here, at start-up) and return the server; the caller runs it."""
    ThreadingWSGIServer.daemon_threads = True
    return make_server(cfg.addr, cfg.port, app, ThreadingWSGIServer, handler_class=_QuietHandler)
