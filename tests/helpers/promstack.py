"""Run Debian's real Prometheus and Alertmanager on 127.0.0.1 for tests.

Three context managers, each owning exactly the process or thread it starts:

    with WebhookReceiver() as hook, \\
         AlertmanagerServer(config_text=am_yaml_with(hook.url("/page"))) as am, \\
         PrometheusServer(targets=["127.0.0.1:9400"], rule_files=[rules],
                          alertmanager=am.address) as prom:
        prom.wait_for(lambda: prom.query('up == 1'), timeout=30)
        hook.wait_for(lambda d: d.payload["status"] == "firing", timeout=60)

Servers use temporary storage, pick a free loopback port, wait on
``/-/ready`` before returning, and are stopped by PID on exit (SIGTERM, then
SIGKILL). Only stdlib HTTP (urllib, http.server) and PyYAML are used.

Prometheus 2.42 waits ~5 s before its first scrape (scrape-manager reload
throttle), so budget for it in timeouts.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

import yaml

PROMETHEUS_BIN = "prometheus"
ALERTMANAGER_BIN = "prometheus-alertmanager"  # Debian's name for the binary
LOOPBACK = "127.0.0.1"

T = TypeVar("T")

try:  # the jobs helper's free_port; a private fallback keeps this module usable alone
    from tests.helpers.jobs import free_port  # type: ignore[attr-defined]
except Exception:  # noqa: BLE001 - any import problem means "not there yet"

    def free_port() -> int:
        """A TCP port on 127.0.0.1 that was free a moment ago."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((LOOPBACK, 0))
            return s.getsockname()[1]


def poll(fn: Callable[[], T], timeout: float, interval: float = 0.2, what: str = "condition") -> T:
    """Call ``fn`` until it returns something truthy; return it, or raise after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            result = fn()
            if result:
                return result
        except Exception as e:  # noqa: BLE001 - retried until the deadline
            last_error = e
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}"
                               + (f" (last error: {last_error!r})" if last_error else ""))
        time.sleep(interval)


def http_get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.load(resp)


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the thread that started us exits
    (Linux PR_SET_PDEATHSIG), so a test runner killed mid-test leaves no server behind."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass


class _Daemon:
    """A server binary started on a free loopback port with a private temp dir."""

    name = "daemon"

    def __init__(self) -> None:
        self.port = free_port()
        self.tmpdir = Path(tempfile.mkdtemp(prefix=f"rankscope-{self.name}-"))
        self.log_path = self.tmpdir / f"{self.name}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def _command(self) -> list[str]:
        raise NotImplementedError

    def start(self, ready_timeout: float = 30.0) -> None:
        with open(self.log_path, "wb") as log:
            # New session: a Ctrl-C in the terminal reaches pytest, which then
            # stops us by PID, instead of racing us.
            # Note: the parent-death signal follows the starting *thread*; start
            # and stop a server in the same thread (or the main one).
            self.proc = subprocess.Popen(self._command(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=_die_with_parent)

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as resp:
                    return resp.status == 200
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                return False

        try:
            deadline = time.monotonic() + ready_timeout
            while not ready():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name} not ready after {ready_timeout}s:\n{self.log()}")
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()  # by PID: Popen.terminate signals exactly this process
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class PrometheusServer(_Daemon):
    """Debian's Prometheus 2.42 on 127.0.0.1 with temporary TSDB storage.

    Give either a full config (``config``: YAML text, a dict, or a path) or let
    it build one from ``targets`` (``host:port`` strings scraped as job
    ``job_name``), ``rule_files`` and ``alertmanager`` (``host:port``).
    ``scrape_interval``/``evaluation_interval`` default to 1s: test-only values.
    """

    name = "prometheus"

    def __init__(self, config: str | dict | os.PathLike | None = None, *,
                 targets: Iterable[str] = (), rule_files: Iterable[str | os.PathLike] = (),
                 alertmanager: str | None = None, job_name: str = "rankscope",
                 scrape_interval: str = "1s", evaluation_interval: str = "1s",
                 extra_args: Iterable[str] = ()) -> None:
        super().__init__()
        self.extra_args = list(extra_args)
        self.config_path = self.tmpdir / "prometheus.yml"
        if isinstance(config, os.PathLike):
            text = Path(config).read_text()
        elif isinstance(config, dict):
            text = yaml.safe_dump(config, sort_keys=False)
        elif isinstance(config, str):
            text = config
        else:
            text = yaml.safe_dump(self.build_config(
                targets=targets, rule_files=rule_files, alertmanager=alertmanager, job_name=job_name,
                scrape_interval=scrape_interval, evaluation_interval=evaluation_interval), sort_keys=False)
        self.config_path.write_text(text)

    @staticmethod
    def build_config(*, targets: Iterable[str] = (), rule_files: Iterable[str | os.PathLike] = (),
                     alertmanager: str | None = None, job_name: str = "rankscope",
                     scrape_interval: str = "1s", evaluation_interval: str = "1s") -> dict:
        config: dict[str, Any] = {
            "global": {"scrape_interval": scrape_interval, "evaluation_interval": evaluation_interval,
                       "scrape_timeout": scrape_interval},
            "rule_files": [str(Path(p).resolve()) for p in rule_files],
            "scrape_configs": [{"job_name": job_name, "static_configs": [{"targets": list(targets)}]}],
        }
        if alertmanager:
            config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
        return config

    def _command(self) -> list[str]:
        return [PROMETHEUS_BIN,
                f"--config.file={self.config_path}",
                f"--storage.tsdb.path={self.tmpdir / 'data'}",
                f"--web.listen-address={self.address}",
                f"--web.external-url={self.url}",
                "--web.enable-lifecycle",
                *self.extra_args]

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>; returns the ``data`` member, raises on an API error."""
        query = ("?" + urllib.parse.urlencode(params)) if params else ""
        body = http_get_json(f"{self.url}/api/v1/{path}{query}")
        if body.get("status") != "success":
            raise RuntimeError(f"Prometheus API error for {path}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """Instant query; a list of ``{"metric": {...}, "value": [ts, "v"]}`` dicts."""
        data = self.api("query", query=expr)
        if data["resultType"] != "vector":
            raise ValueError(f"{expr!r} returned a {data['resultType']}, not a vector")
        return data["result"]

    def alerts(self) -> list[dict]:
        """Pending and firing alerts: dicts with labels, annotations, state, activeAt, value."""
        return self.api("alerts")["alerts"]

    def rules(self) -> list[dict]:
        return self.api("rules")["groups"]

    def targets(self) -> list[dict]:
        return self.api("targets")["activeTargets"]

    def wait_for(self, fn: Callable[[], T], timeout: float = 30.0, what: str = "condition") -> T:
        return poll(fn, timeout, what=what)

    def wait_for_scrape(self, timeout: float = 30.0) -> list[dict]:
        """Wait until every target has been scraped successfully at least once."""
        def all_up() -> list[dict]:
            ts = self.targets()
            return ts if ts and all(t["health"] == "up" for t in ts) else []
        return poll(all_up, timeout, what="all targets up")

    def reload(self) -> None:
        req = urllib.request.Request(self.url + "/-/reload", method="POST")
        urllib.request.urlopen(req, timeout=10).close()


class AlertmanagerServer(_Daemon):
    """Debian's Alertmanager 0.25 (``prometheus-alertmanager``) on 127.0.0.1.

    Clustering is off (``--cluster.listen-address=``) so it opens no gossip
    port and needs no peers; storage is a temp dir.
    """

    name = "alertmanager"

    def __init__(self, config_path: str | os.PathLike | None = None, *, config_text: str | None = None,
                 extra_args: Iterable[str] = ()) -> None:
        super().__init__()
        if (config_path is None) == (config_text is None):
            raise ValueError("give exactly one of config_path and config_text")
        self.config_path = self.tmpdir / "alertmanager.yml"
        self.config_path.write_text(config_text if config_text is not None else Path(config_path).read_text())
        self.extra_args = list(extra_args)

    def _command(self) -> list[str]:
        return [ALERTMANAGER_BIN,
                f"--config.file={self.config_path}",
                f"--storage.path={self.tmpdir / 'data'}",
                f"--web.listen-address={self.address}",
                f"--web.external-url={self.url}",
                "--cluster.listen-address=",
                *self.extra_args]

    def alerts(self) -> list[dict]:
        """Alerts Alertmanager currently holds (API v2), with ``status.inhibitedBy`` etc."""
        return http_get_json(self.url + "/api/v2/alerts")


@dataclass
class Delivery:
    """One POST received by the WebhookReceiver."""

    path: str
    payload: Any
    received_at: float  # time.time() on arrival
    received_monotonic: float = field(repr=False, default=0.0)

    @property
    def alerts(self) -> list[dict]:
        return self.payload.get("alerts", []) if isinstance(self.payload, dict) else []


class WebhookReceiver:
    """A real HTTP server thread on 127.0.0.1 that records Alertmanager webhook POSTs.

    Point receivers at ``hook.url("/page")``, ``hook.url("/chat")`` etc.; every
    POST is stored as a :class:`Delivery` (path, parsed JSON, arrival time).
    """

    def __init__(self) -> None:
        self.deliveries: list[Delivery] = []
        self._cond = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                try:
                    payload = json.loads(raw)
                except ValueError:
                    payload = raw.decode(errors="replace")
                receiver._record(Delivery(self.path, payload, time.time(), time.monotonic()))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:  # keep test output clean
                pass

        self._server = ThreadingHTTPServer((LOOPBACK, 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="webhook-receiver", daemon=True)

    def url(self, path: str = "/") -> str:
        return f"http://{LOOPBACK}:{self.port}{path}"

    def _record(self, delivery: Delivery) -> None:
        with self._cond:
            self.deliveries.append(delivery)
            self._cond.notify_all()

    def snapshot(self) -> list[Delivery]:
        with self._cond:
            return list(self.deliveries)

    def wait_for(self, match: Callable[[Delivery], bool], timeout: float) -> Delivery:
        """The first delivery (already received or arriving within ``timeout`` s) for which ``match`` is true."""
        deadline = time.monotonic() + timeout
        with self._cond:
            seen = 0
            while True:
                for d in self.deliveries[seen:]:
                    if match(d):
                        return d
                seen = len(self.deliveries)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no matching webhook delivery within {timeout}s; "
                                       f"got {[(d.path, d.payload) for d in self.deliveries]}")
                self._cond.wait(remaining)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> "WebhookReceiver":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def firing_alerts(delivery: Delivery, alertname: str | None = None) -> list[dict]:
    """The firing alerts of a delivery, optionally only those named ``alertname``."""
    return [a for a in delivery.alerts
            if a.get("status") == "firing" and (alertname is None or a["labels"].get("alertname") == alertname)]
