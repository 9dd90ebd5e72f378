"""Monitor configuration: one small dataclass, validated at start-up.

Every option can come from the constructor or from a ``RANKSCOPE_*``
environment variable; a bad value raises ``ConfigError`` naming the option
before training starts, never later.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from rankscope import sinks
from rankscope.publishing import stacks
from rankscope.contract import environment
from rankscope.contract.catalog import MAX_PROCESS_GROUPS_DEFAULT
from rankscope.contract.environment import DEFAULT_ADDR, DEFAULT_PORT, ConfigError
from rankscope.contract.rundir import default_metrics_dir
from rankscope.layout import Layout

__all__ = ["MonitorConfig", "ConfigError"]

COMM_TIMING_MODES = ("auto", "hook", "reducer", "off")
EXPORTER_MODES = ("auto", "external", "off")


@dataclass(frozen=True)
class MonitorConfig:
    """What the rank-side monitor does. Environment: ``RANKSCOPE_<FIELD>``."""

    run: str | None = None
    """Run identity; default: TORCHELASTIC_RUN_ID, Slurm or Kubernetes job id."""
    metrics_dir: Path = field(default_factory=default_metrics_dir)
    """Directory shared with the node exporter (one sub-directory per run)."""
    exporter: str = "auto"
    """auto: start the node exporter if none serves metrics_port; external: expect one; off: write files only."""
    metrics_port: int = DEFAULT_PORT
    metrics_addr: str = DEFAULT_ADDR
    publish_interval_s: float = 0.5
    """How often the background thread beats and publishes buffered values."""
    loss_window: int = 100
    """Steps in the rolling window for the loss z-score."""
    loss_ema_alpha: float = 0.05
    spike_zscore: float = 6.0
    """A loss this many standard deviations above its rolling mean is a spike."""
    spike_warmup_steps: int = 20
    grad_spike_factor: float = 10.0
    """A gradient norm this many times its moving average is an explosion."""
    comm_timing: str = "auto"
    """How watch() times a DDP model's all-reduces. hook: every bucket, through a
    comm hook (CUDA events on GPU; on CPU the hook costs 3-5% of the step);
    reducer: no hook, DDP's own timers read every 10th step, the all-reduce
    counted in flight during the backward phase; auto: hook on CUDA, reducer
    on CPU; off: none."""
    memory_every_s: float = 2.0
    """How often device and host memory are sampled (background thread)."""
    flight_recorder_after_s: float = 60.0
    """Dump torch's flight recorder (if on) once a collective has been in flight this long."""
    tensorboard_dir: Path | None = None
    """Rank 0 writes one step-indexed TensorBoard run of job-wide figures to <dir>/<run> (docs/sinks.md)."""
    mlflow_tracking_uri: str | None = None
    """Rank 0 logs the same figures to one MLflow run here (http(s)://, sqlite:///..., ...). The standard
    MLFLOW_TRACKING_URI is not read: it is the user's own logging's (docs/sinks.md)."""
    mlflow_experiment: str = "rankscope"
    sink_interval_s: float = 10.0
    """How often rank 0's sink reads the exporters and writes one record."""
    sink_exporters: str | None = None
    """Other nodes' exporters (host:port,host:port) the sink reads besides this node's."""
    max_process_groups: int = MAX_PROCESS_GROUPS_DEFAULT
    """Process groups per rank whose collectives are read from torch's flight recorder; 0 turns the reading off."""
    stack_signal: str = "SIGRTMIN+9"
    """The signal the node exporter sends for this rank's stacks (rankscope.publishing.stacks): a name
    (SIGUSR2, SIGRTMIN+9) or number, or off."""
    collective_timing: bool = False
    """Turn on each process group's own collective timing (NCCL: device durations in the flight recorder;
    docs/collectives.md)."""
    replica_check_every: int = 100
    """Every this many steps, a fingerprint of the tensors the rank holds a replica of (DDP's parameters,
    DTensors placed Replicate()), compared across the replicas by the rules (rankscope.replicas); 0: off."""
    layout: str | None = None
    """The rank's coordinates in the job's parallel layout, ``pp=1,dp=0,tp=3`` (rankscope.layout), for
    launchers that know them (Megatron-style ``RANKSCOPE_LAYOUT=pp=$PP_RANK``); a device mesh or a
    pipeline stage given to ``watch()`` adds what this leaves out."""

    def __post_init__(self) -> None:
        if self.run is not None and not _valid_label_value(self.run):
            raise ConfigError(f"run: {self.run!r} must be 1-128 printable characters")
        if self.exporter not in EXPORTER_MODES:
            raise ConfigError(f"exporter: {self.exporter!r} is not one of {', '.join(EXPORTER_MODES)}")
        if self.comm_timing not in COMM_TIMING_MODES:
            raise ConfigError(f"comm_timing: {self.comm_timing!r} is not one of {', '.join(COMM_TIMING_MODES)}")
        if not (0 < self.metrics_port < 65536):
            raise ConfigError(f"metrics_port: {self.metrics_port} is not a TCP port (1-65535)")
        for name in ("publish_interval_s", "memory_every_s", "loss_ema_alpha", "spike_zscore", "grad_spike_factor",
                     "flight_recorder_after_s", "sink_interval_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}: must be > 0, got {getattr(self, name)!r}")
        if not self.loss_ema_alpha <= 1:
            raise ConfigError(f"loss_ema_alpha: must be in (0, 1], got {self.loss_ema_alpha}")
        if self.loss_window < 2:
            raise ConfigError(f"loss_window: must be >= 2, got {self.loss_window}")
        stacks.parse_signal(self.stack_signal)
        Layout.parse(self.layout)
        if self.max_process_groups < 0:
            raise ConfigError(f"must be >= 0 (0 turns the reading off), got {self.max_process_groups}",
                              field="max_process_groups")
        if self.replica_check_every < 0:
            raise ConfigError(f"must be >= 0 (0 turns the check off), got {self.replica_check_every}",
                              field="replica_check_every")
        if self.spike_warmup_steps < 0:
            raise ConfigError(f"spike_warmup_steps: must be >= 0, got {self.spike_warmup_steps}")
        if self.metrics_dir.exists() and not self.metrics_dir.is_dir():
            raise ConfigError(f"metrics_dir: {self.metrics_dir} exists and is not a directory")
        if self.tensorboard_dir is not None and Path(self.tensorboard_dir).exists() \
                and not Path(self.tensorboard_dir).is_dir():
            raise ConfigError(f"{self.tensorboard_dir} exists and is not a directory", field="tensorboard_dir")
        if self.mlflow_tracking_uri is not None:
            sinks.check_mlflow_uri(self.mlflow_tracking_uri)
        if not self.mlflow_experiment.strip():
            raise ConfigError("must not be empty", field="mlflow_experiment")
        sinks.exporter_urls(self.sink_exporters)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> "MonitorConfig":
        """Explicit arguments win over ``RANKSCOPE_*`` variables, which win over defaults."""
        return environment.from_env(cls, env, **overrides)


def _valid_label_value(value: str) -> bool:
    return 0 < len(value) <= 128 and value.isprintable()
