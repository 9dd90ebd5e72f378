"""Memory readings, taken by the background publisher (never on the hot path).

CUDA: the caching allocator's own counters (``torch.cuda.memory_stats``), a
host-side read that does not synchronise the device. CPU runs: the process RSS
from /proc and the memory limit of the cgroup (or of the host).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class MemoryReading:
    rss: float
    allocated: float = 0.0
    reserved: float = 0.0
    peak: float = 0.0
    retries: float = 0.0     # cumulative, from the allocator
    ooms: float = 0.0        # cumulative, from the allocator


def rss_bytes() -> float:
    with open("/proc/self/statm") as f:
        return float(f.read().split()[1]) * _PAGE


def host_limit_bytes() -> float:
    """The memory limit of this process's cgroup (v2 or v1), or the host's
    physical memory when there is none.

    The cgroup is the process's own, from /proc/self/cgroup: under Slurm or
    systemd without a cgroup namespace, the files at the mount's root belong
    to the root cgroup, which has no limit."""
    total = float(os.sysconf("SC_PHYS_PAGES") * _PAGE)
    for path in _cgroup_limit_files():
        try:
            raw = path.read_text().strip()
        except OSError:
            continue
        if raw.isdigit() and 0 < int(raw) < total:
            return float(raw)
    return total


def _cgroup_limit_files(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> list[Path]:
    """memory.max (v2) / memory.limit_in_bytes (v1) of this process's cgroup, then of the mount's root."""
    v2 = v1 = ""
    try:
        for line in Path(proc_cgroup).read_text().splitlines():
            hierarchy, controllers, path = line.split(":", 2)
            if hierarchy == "0" and controllers == "":
                v2 = path
            elif "memory" in controllers.split(","):
                v1 = path
    except (OSError, ValueError):
        pass
    base = Path(root)
    candidates = []
    for mount in (base, base / "unified"):
        if v2:
            candidates.append(mount / v2.lstrip("/") / "memory.max")
    if v1:
        candidates.append(base / "memory" / v1.lstrip("/") / "memory.limit_in_bytes")
    candidates += [base / "memory.max", base / "memory" / "memory.limit_in_bytes"]
    return candidates


class MemorySampler:
    """Reads the rank's memory: its CUDA device's (``device.RankDevice``, once known, by its
    explicit index, inside its guard: this runs on the publisher thread) and the host's."""

    def __init__(self, device):
        self.device = device
        self.host_limit = host_limit_bytes()

    @property
    def cuda(self) -> bool:
        return self.device.cuda

    def total(self) -> float:
        """The device's memory in bytes; 0 before a CUDA device is known."""
        return float(self.device.total_memory) if self.device.cuda else 0.0

    def read(self) -> MemoryReading:
        reading = MemoryReading(rss=rss_bytes())
        if self.device.cuda:
            stats = self.device.api.memory_stats(self.device.index)
            reading.allocated = float(stats.get("allocated_bytes.all.current", 0))
            reading.reserved = float(stats.get("reserved_bytes.all.current", 0))
            reading.peak = float(stats.get("allocated_bytes.all.peak", 0))
            reading.retries = float(stats.get("num_alloc_retries", 0))
            reading.ooms = float(stats.get("num_ooms", 0))
        return reading
