"""rankscope's rank side: the instrumentation API a training loop calls.

``from rankscope import Monitor`` is the whole public surface for most users;
the submodules (catalog, config, ...) import nothing heavy, so that the
exporter and tools can read the metric catalog without importing torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["Monitor", "MonitorConfig", "ConfigError", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Monitor":
        from rankscope.monitor import Monitor

        return Monitor
    if name in ("MonitorConfig", "ConfigError"):
        from rankscope import config

        return getattr(config, name)
    raise AttributeError(name)
