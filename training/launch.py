"""Find or start the node's exporter, so that one command gives a live /metrics.

Called by local rank 0 at start-up. The exporter is started in a new session:
when torchrun tears the job down (a rank died) it kills its ranks' process
groups, and the exporter must survive to report that. It exits by itself once
no rank of any run in its directory has been alive for a while and the runs it
served are past their retention (and removed). Its log is ``exporter.log`` in
the metrics directory.

Start-up never fails because of the exporter: the ranks write their metric
files whether or not one answers. A port that accepts but does not answer (an
exporter that is stopped, hung or busy), an exporter that is slow to start or
dies at start, and ``exporter=external`` with none answering yet each get a
warning; where rankscope starts the exporter, it goes on waiting for it, and
starts it once more if it died, on a background thread. Only what is certainly
wrong raises ``ConfigError``: a port held by something that is not a rankscope
exporter, or by this user's exporter of another directory.

Users share nodes: each has a metrics directory of their own, but the port is
the node's. Where another user's exporter holds the port, this user's is
started on a free one (said once, with its URL); the exporter writes where it
listens into its directory (``exporter.json``), so the user's later jobs and
``rankscope top`` find it there.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from rankscope.contract.environment import ConfigError, env_value, metrics_url
from rankscope.contract.rundir import exporter_address

log = logging.getLogger("rankscope")

HEALTH_PATH = "/healthz"
START_WAIT_S = 5.0        # the rank waits this long for an exporter it started; a background thread after
START_TIMEOUT_S = 60.0    # ... until this long, then gives up (said once)
IDLE_EXIT_S = 300


class NoAnswer(Exception):
    """Something holds the port but no answer came (a stopped, hung or busy exporter)."""


def probe(addr: str, port: int, timeout: float = 1.0) -> dict | None:
    """The exporter's health document, None if nothing listens; raises ``NoAnswer`` if the port
    does not answer in time, ConfigError if something that is not a rankscope exporter holds it."""
    url = f"http://{addr}:{port}{HEALTH_PATH}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body = resp.read()
    except urllib.error.HTTPError as e:
        raise ConfigError(f"metrics_port: {addr}:{port} is in use by something else (HTTP {e.code} on {HEALTH_PATH})")
    except (ConnectionError, urllib.error.URLError, TimeoutError, OSError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, ConnectionRefusedError) or isinstance(e, ConnectionRefusedError):
            return None
        raise NoAnswer(f"{addr}:{port}: {reason}") from None
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or doc.get("service") != "rankscope-exporter":
        raise ConfigError(f"metrics_port: {addr}:{port} is in use by something that is not a rankscope exporter")
    return doc


def ensure_exporter(addr: str, port: int, directory: Path, mode: str) -> str:
    """The /metrics URL of the exporter serving ``directory``: the one on ``addr:port``, else the
    one its directory says it runs, else one started now (``mode`` is MonitorConfig.exporter:
    ``auto`` starts, ``external`` only expects). Never raises for an exporter that is slow, hung
    or absent (the module docstring)."""
    try:
        doc = probe(addr, port)
    except NoAnswer as e:
        log.warning("rankscope: the node exporter does not answer (%s): this rank writes its metric files as "
                    "always; they are served once an exporter of %s answers on that port", e, directory)
        return metrics_url(addr, port)
    if doc is not None and _serves(doc, directory):
        return metrics_url(addr, port)
    if doc is not None and not _another_users(doc):
        raise ConfigError(
            f"metrics_port: the exporter on {addr}:{port} serves {doc['directory']}, not {directory}; "
            "use the same RANKSCOPE_METRICS_DIR or another port")
    # Nothing on the port, or another user's exporter holds it.
    recorded = exporter_address(directory)
    if recorded is not None:
        own = _probe_quietly(*recorded)
        if own is not None and _serves(own, directory):
            return metrics_url(*recorded)
    if mode == "external":
        held = f"; {addr}:{port} serves another user's metrics ({doc['directory']})" if doc is not None else ""
        log.warning("rankscope: exporter=external but no rankscope exporter of this user answers on %s:%d%s: this "
                    "rank writes its metric files as always; they are served once one answers", addr, port, held)
        return metrics_url(addr, port)
    if doc is None:
        doc = _start(addr, port, directory)
        if doc is None or _serves(doc, directory):   # None: not answering yet, waited for in the background
            return metrics_url(addr, port)
        # Another user's exporter took the port meanwhile: this user's goes elsewhere.
    free = _free_port(addr)
    _start(addr, free, directory)
    url = metrics_url(addr, free)
    log.warning("rankscope: %s:%d is another user's exporter (for %s); this user's node exporter serves %s "
                "(Prometheus scrapes %d by default: add this port to its targets to see these runs there)",
                addr, port, doc["directory"], url, port)
    return url


def _serves(doc: dict, directory: Path) -> bool:
    return Path(doc["directory"]).resolve() == directory.resolve()


def _another_users(doc: dict) -> bool:
    """Whether an exporter (its health document) runs for another user: said by it, else by its directory's owner."""
    uid = doc.get("uid")
    if uid is None:
        try:
            uid = Path(doc["directory"]).stat().st_uid
        except OSError:
            return True   # a directory this user cannot even see is not this user's
    return int(uid) != os.getuid()


def _probe_quietly(addr: str, port: int) -> dict | None:
    try:
        return probe(addr, port, timeout=0.5)
    except (ConfigError, NoAnswer):
        return None


def _free_port(addr: str) -> int:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def _start(addr: str, port: int, directory: Path) -> dict | None:
    """Start this user's exporter on ``addr:port``; its health document once it answers (within
    START_WAIT_S), else None, and a background thread waits on (``_StartWatch``)."""
    proc = _spawn(addr, port, directory)
    deadline = time.monotonic() + START_WAIT_S
    while time.monotonic() < deadline:
        doc = _probe_quietly(addr, port)
        if doc is not None:
            return doc
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    _StartWatch(addr, port, directory, proc).start()
    return None


def _spawn(addr: str, port: int, directory: Path) -> subprocess.Popen:
    directory.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    # -P: the rank's working directory is not put on sys.path, so a user's own
    # exporter.py (or rankscope/) there cannot stand in for the exporter.
    idle_exit = env_value(os.environ, "RANKSCOPE_EXIT_WHEN_IDLE_S", float, IDLE_EXIT_S)
    cmd = [sys.executable, "-P", "-m", "rankscope.exporter", "--addr", addr, "--port", str(port),
           "--dir", str(directory), "--exit-when-idle", str(idle_exit)]
    with open(directory / "exporter.log", "ab") as log_file:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file, env=env,
                                start_new_session=True, close_fds=True)


class _StartWatch(threading.Thread):
    """An exporter this rank started that has not answered yet: waited for off the training
    thread until START_TIMEOUT_S, started once more if it died while the port stayed free
    (another rank's launcher may have won the race for it), and said once either way."""

    def __init__(self, addr: str, port: int, directory: Path, proc: subprocess.Popen):
        super().__init__(name="rankscope-exporter-start", daemon=True)
        self.addr, self.port, self.directory, self.proc = addr, port, directory, proc
        self.answered: dict | None = None
        status = (f"exited at start (code {proc.returncode})" if proc.poll() is not None
                  else f"has not answered within {START_WAIT_S:.0f} s of its start")
        log.warning("rankscope: the node exporter on %s:%d %s; training goes on, and it is waited for in the "
                    "background (log: %s)", addr, port, status, directory / "exporter.log")

    def run(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S - START_WAIT_S
        restarted = False
        while time.monotonic() < deadline:
            doc = _probe_quietly(self.addr, self.port)
            if doc is not None:
                self.answered = doc
                if _serves(doc, self.directory):
                    log.warning("rankscope: the node exporter answers on %s:%d", self.addr, self.port)
                else:
                    log.warning("rankscope: another exporter (for %s) took %s:%d: this user's runs are not served "
                                "there", doc["directory"], self.addr, self.port)
                return
            if self.proc.poll() is not None:
                if restarted or _port_taken(self.addr, self.port):
                    break
                restarted = True
                self.proc = _spawn(self.addr, self.port, self.directory)
            time.sleep(0.5)
        tail = (self.directory / "exporter.log").read_text(errors="replace").strip().splitlines()[-3:]
        log.warning("rankscope: the node exporter on %s:%d did not start (%s): this rank's metric files are "
                    "written, but nothing serves them until an exporter of %s runs (log: %s)", self.addr, self.port,
                    " | ".join(tail) or "no output", self.directory, self.directory / "exporter.log")


def _port_taken(addr: str, port: int) -> bool:
    """Whether something listens on the port (an exporter that another rank's launcher started)."""
    try:
        return probe(addr, port, timeout=0.5) is not None
    except (NoAnswer, ConfigError):
        return True
