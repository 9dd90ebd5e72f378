"""Exporter configuration: one validated dataclass, built by ``from_env``.

Each option's default is written once, on its field below, with the
environment variable it is read from and its command-line flag. Command-line
values win over the environment, which wins over the defaults
(``rankscope.contract.environment.from_env``); an error names the flag or
the variable the wrong value came from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from rankscope.contract import environment
from rankscope.contract.environment import DEFAULT_ADDR, DEFAULT_PORT, ConfigError, default_node, setting
from rankscope.contract.rundir import default_metrics_dir
from rankscope.exporter.network import DEFAULT_EXCLUDED_DEVICES


# How per-rank histograms are served (rankscope.exporter.cardinality; docs/scaling.md, "Cardinality controls").
RANK_HISTOGRAM_MODES: tuple[str, ...] = ("full", "sum-count", "node-buckets")


class ExporterConfigError(ConfigError):
    """A bad option; the message names it. The CLI prints it and exits 2."""


@dataclass(frozen=True)
class ExporterConfig:
    directory: Path = setting(default_factory=default_metrics_dir, env="RANKSCOPE_METRICS_DIR", option="--dir")
    """The metrics directory shared with the ranks."""
    addr: str = setting(default=DEFAULT_ADDR, env="RANKSCOPE_METRICS_ADDR", option="--addr")
    port: int = setting(default=DEFAULT_PORT, env="RANKSCOPE_METRICS_PORT", option="--port")
    node: str = setting(default_factory=default_node, env="RANKSCOPE_NODE", option="--node")
    stuck_after_s: float = setting(default=30.0, env="RANKSCOPE_STUCK_AFTER_S", option="--stuck-after")
    """No step completed for this long while the heartbeat is live: stuck."""
    stuck_after_steps: float = setting(default=3.0, env="RANKSCOPE_STUCK_AFTER_STEPS", option="--stuck-after-steps")
    """... and for this many of the rank's own recent step times (the longest of its last 16): a job
    with 45 s steps is not stuck between two steps, and its hang is found within 3 steps."""
    frozen_after_s: float = setting(default=10.0, env="RANKSCOPE_FROZEN_AFTER_S", option="--frozen-after")
    """Heartbeat older than this while the process is alive: frozen."""
    suspect_after_s: float = setting(default=10.0, env="RANKSCOPE_SUSPECT_AFTER_S", option="--suspect-after")
    """Peers waiting in a collective this long make a rank outside any collective a hang suspect."""
    first_step_suspect_after_s: float = setting(default=120.0, env="RANKSCOPE_FIRST_STEP_SUSPECT_AFTER_S",
                                                option="--first-step-suspect-after")
    """... and for a rank that has not completed its first step, this long: a first compile or checkpoint
    load may keep one rank far longer than its peers (the rules' first_step_wait_seconds)."""
    retention_s: float = setting(default=900.0, env="RANKSCOPE_RETENTION_S", option="--retention")
    """A run whose ranks are all gone is served this long, then its files are removed."""
    compact_after_s: float = setting(default=30.0, option="--compact-after")
    """Fold a dead rank process's files into its launch's compacted files once it has been dead this long
    (rankscope.exporter.compaction)."""
    exit_when_idle_s: float = setting(default=0.0, env="RANKSCOPE_EXIT_WHEN_IDLE_S", option="--exit-when-idle")
    """Exit after no rank has been alive for this long and the runs served are past their retention
    (0: never; auto-started exporters: 300)."""
    rank_histograms: str = setting(default="full", env="RANKSCOPE_RANK_HISTOGRAMS", option="--rank-histograms")
    """full: every bucket of every rank; sum-count: each per-rank histogram as its _sum and _count only;
    node-buckets: sum-count plus the buckets summed over the node's ranks (rankscope_node_*)."""
    nvml: bool = setting(default=True, option="--no-nvml")
    network: bool = setting(default=True, option="--no-network")
    """Read the node's network devices and TCP counters (rankscope.exporter.network)."""
    network_excluded_devices: str = setting(default=DEFAULT_EXCLUDED_DEVICES,
                                            env="RANKSCOPE_NETWORK_EXCLUDED_DEVICES",
                                            option="--network-excluded-devices")
    """Network devices left out (a regular expression over the whole name): virtual ones by default."""
    evidence: bool = setting(default=True, option="--no-evidence")
    """Capture evidence of a rank that stops making progress (rankscope.exporter.evidence)."""
    evidence_max_episodes: int = setting(default=16, env="RANKSCOPE_EVIDENCE_MAX_EPISODES",
                                         option="--evidence-max-episodes")
    """Evidence captures kept per run (one per episode of a rank)."""
    web_config: Path | None = setting(default=None, option="--web-config")
    """exporter-toolkit web configuration file (TLS, basic auth)."""

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ExporterConfigError(f"{self.port} is not a TCP port (1-65535)", field="port")
        for name in ("stuck_after_s", "stuck_after_steps", "frozen_after_s", "suspect_after_s", "first_step_suspect_after_s",
                     "retention_s"):
            if not getattr(self, name) > 0:
                raise ExporterConfigError(f"must be > 0, got {getattr(self, name)!r}", field=name)
        if not self.compact_after_s >= 0:
            raise ExporterConfigError(f"must be >= 0, got {self.compact_after_s!r}", field="compact_after_s")
        if self.evidence_max_episodes < 0:
            raise ExporterConfigError(f"must be >= 0, got {self.evidence_max_episodes!r}", field="evidence_max_episodes")
        if not self.exit_when_idle_s >= 0:
            raise ExporterConfigError(f"must be >= 0, got {self.exit_when_idle_s!r}", field="exit_when_idle_s")
        if self.rank_histograms not in RANK_HISTOGRAM_MODES:
            raise ExporterConfigError(f"must be one of {', '.join(RANK_HISTOGRAM_MODES)}, got {self.rank_histograms!r}",
                                      field="rank_histograms")
        try:
            re.compile(self.network_excluded_devices)
        except re.error as e:
            raise ExporterConfigError(f"not a regular expression: {e}", field="network_excluded_devices") from None
        if self.directory.exists() and not self.directory.is_dir():
            raise ExporterConfigError(f"{self.directory} exists and is not a directory", field="directory")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **explicit: Any) -> "ExporterConfig":
        """Explicit values (the command line's; None: not given) win over the
        environment, which wins over the defaults."""
        return environment.from_env(cls, env, **explicit)
