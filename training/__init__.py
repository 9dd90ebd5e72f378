"""rankscope: per-rank telemetry for PyTorch distributed training.

``from rankscope import Monitor`` is the whole public surface for most users.
Names are imported lazily, so that ``import rankscope`` (and the node
exporter, ``rankscope.exporter``, and the contract it shares with the ranks,
``rankscope.contract``) does not import torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["Monitor", "MonitorConfig", "FlopsConfig", "ConfigError", "UsageError", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Monitor":
        from rankscope.monitor import Monitor

        return Monitor
    if name == "MonitorConfig":
        from rankscope.config import MonitorConfig

        return MonitorConfig
    if name == "FlopsConfig":
        from rankscope.flops import FlopsConfig

        return FlopsConfig
    if name == "ConfigError":
        from rankscope.contract.environment import ConfigError

        return ConfigError
    if name == "UsageError":
        from rankscope.errors import UsageError

        return UsageError
    raise AttributeError(name)
