"""Exporter configuration: a validated dataclass built from the command line."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path


class ExporterConfigError(ValueError):
    """A bad option; the message names it. The CLI prints it and exits 2."""


def default_node() -> str:
    return os.environ.get("RANKSCOPE_NODE") or os.environ.get("SLURMD_NODENAME") or os.environ.get(
        "NODE_NAME") or socket.gethostname()


@dataclass(frozen=True)
class ExporterConfig:
    directory: Path
    addr: str = "127.0.0.1"
    port: int = 9400
    node: str = ""
    stuck_after_s: float = 30.0
    """No step completed for this long while the heartbeat is live: stuck."""
    frozen_after_s: float = 10.0
    """Heartbeat older than this while the process is alive: frozen."""
    suspect_after_s: float = 10.0
    """Peers waiting in a collective this long make a rank outside any collective a hang suspect."""
    retention_s: float = 900.0
    """A run whose ranks are all gone is served this long, then its files are removed."""
    exit_when_idle_s: float = 0.0
    """Exit after no rank has been alive for this long (0: never; for auto-started exporters)."""
    nvml: bool = True
    web_config: Path | None = None

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ExporterConfigError(f"--port: {self.port} is not a TCP port (1-65535)")
        for name in ("stuck_after_s", "frozen_after_s", "suspect_after_s", "retention_s"):
            if not getattr(self, name) > 0:
                raise ExporterConfigError(f"--{name[:-2].replace('_', '-')}: must be > 0")
        if self.exit_when_idle_s < 0:
            raise ExporterConfigError("--exit-when-idle: must be >= 0")
        if self.directory.exists() and not self.directory.is_dir():
            raise ExporterConfigError(f"--dir: {self.directory} exists and is not a directory")
