"""Find or start the node's exporter, so that one command gives a live /metrics.

Called by local rank 0 at start-up. The exporter is started in a new session:
when torchrun tears the job down (a rank died) it kills its ranks' process
groups, and the exporter must survive to report that. It exits by itself once
no rank of any run in its directory has been alive for a while.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from rankscope.contract.environment import ConfigError

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


def ensure_exporter(addr: str, port: int, directory: Path, mode: str) -> dict:
    """Reuse the exporter serving ``directory`` on ``addr:port``, or start one
    (``mode`` is MonitorConfig.exporter: ``auto`` starts, ``external`` only expects)."""
    doc = probe(addr, port)
    if doc is None and mode == "external":
        raise ConfigError(f"exporter=external but no rankscope exporter answers on {addr}:{port}")
    if doc is None:
        doc = _start(addr, port, directory)
    if Path(doc["directory"]).resolve() != directory.resolve():
        raise ConfigError(
            f"metrics_port: the exporter on {addr}:{port} serves {doc['directory']}, not {directory}; "
            "use the same RANKSCOPE_METRICS_DIR or another port")
    return doc


def _start(addr: str, port: int, directory: Path) -> dict:
    directory.mkdir(parents=True, exist_ok=True)
    log_path = directory / "exporter.log"
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    # -P: the rank's working directory is not put on sys.path, so a user's own
    # exporter.py (or rankscope/) there cannot stand in for the exporter.
    cmd = [sys.executable, "-P", "-m", "rankscope.exporter", "--addr", addr, "--port", str(port),
           "--dir", str(directory), "--exit-when-idle", str(IDLE_EXIT_S)]
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
