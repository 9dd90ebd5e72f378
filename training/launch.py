"""Find or start the node's exporter, so that one command gives a live /metrics.

Called by local rank 0 at start-up. The exporter is started in a new session:
when torchrun tears the job down (a rank died) it kills its ranks' process
groups, and the exporter must survive to report that. It exits by itself once
no rank of any run in its directory has been alive for a while and the runs it
served are past their retention (and removed). Its log is ``exporter.log`` in
the metrics directory.

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
import time
import urllib.error
import urllib.request
from pathlib import Path

from rankscope.contract.environment import ConfigError, env_value, metrics_url
from rankscope.contract.rundir import exporter_address

log = logging.getLogger("rankscope")

HEALTH_PATH = "/healthz"
START_TIMEOUT_S = 20.0
IDLE_EXIT_S = 300


def probe(addr: str, port: int, timeout: float = 1.0) -> dict | None:
    """The exporter's health document, None if nothing listens; raises
    ConfigError if something that is not a rankscope exporter holds the port."""
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
        raise ConfigError(f"metrics_port: cannot reach {addr}:{port}: {reason}") from None
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
    ``auto`` starts, ``external`` only expects)."""
    doc = probe(addr, port)
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
        raise ConfigError(f"exporter=external but no rankscope exporter of this user answers on {addr}:{port}{held}")
    if doc is None:
        doc = _start(addr, port, directory)
        if _serves(doc, directory):
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
    except ConfigError:
        return None


def _free_port(addr: str) -> int:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def _start(addr: str, port: int, directory: Path) -> dict:
    directory.mkdir(parents=True, exist_ok=True)
    log_path = directory / "exporter.log"
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    # -P: the rank's working directory is not put on sys.path, so a user's own
    # exporter.py (or rankscope/) there cannot stand in for the exporter.
    idle_exit = env_value(os.environ, "RANKSCOPE_EXIT_WHEN_IDLE_S", float, IDLE_EXIT_S)
    cmd = [sys.executable, "-P", "-m", "rankscope.exporter", "--addr", addr, "--port", str(port),
           "--dir", str(directory), "--exit-when-idle", str(idle_exit)]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                start_new_session=True, close_fds=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            doc = probe(addr, port, timeout=0.5)
        except ConfigError:
            doc = None
        if doc is not None:
            return doc
        if proc.poll() is not None:
            # Another rank's launcher may have won the race for the port.
            doc = probe(addr, port)
            if doc is not None:
                return doc
            tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
            raise ConfigError(f"the node exporter failed to start: {' | '.join(tail)} (log: {log_path})")
        time.sleep(0.1)
    raise ConfigError(f"the node exporter did not answer on {addr}:{port} within {START_TIMEOUT_S:.0f} s "
                      f"(log: {log_path})")
