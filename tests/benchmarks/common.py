"""Shared pieces of the benchmark scripts: statistics, tables, machine facts.

Every script prints a human-readable table and, as its very last line, one
JSON object with its figures (``emit_json``), so CI and docs can pick the
numbers up without parsing the table.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Iterable, Sequence

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # the scripts run as files: make `training`, `exporter` importable
    sys.path.insert(0, str(REPO))

Z95 = 1.959964  # normal quantile; every sample here has hundreds of pairs or more


def mean_ci(values: Sequence[float]) -> tuple[float, float, float]:
    """Mean and its 95% confidence interval (normal approximation)."""
    n = len(values)
    mean = statistics.fmean(values)
    if n < 2:
        return mean, math.nan, math.nan
    half = Z95 * statistics.stdev(values) / math.sqrt(n)
    return mean, mean - half, mean + half


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    k = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[k]


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table (pastes straight into docs/performance.md)."""
    rows = [[_cell(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def _cell(value: object) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.0f}"
    return str(value)


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def machine() -> dict:
    """What the figures came from (docs/performance.md quotes this)."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch

        torch_version = torch.__version__
    except Exception:
        torch_version = ""
    return {"nproc": os.cpu_count(), "cpu": cpu, "python": platform.python_version(), "torch": torch_version,
            "kernel": platform.release(), "loadavg": loadavg()}


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


def threads_cpu_seconds(threads) -> float:
    """CPU seconds (user + system) of the given Python threads of this process, from /proc/self/task."""
    total = 0.0
    for t in threads:
        try:
            stat = Path(f"/proc/self/task/{t.native_id}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, TypeError):
            continue
    return total


def proc_rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """VmRSS (current) or VmHWM (peak) of a process, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def emit_json(figures: dict) -> None:
    """The final line of every benchmark: its figures, machine-readable."""
    print(json.dumps(figures, sort_keys=True), flush=True)


def note_rank_pid(out_dir: Path, rank_env: str = "RANK") -> None:
    """A rank writes its pid so the launcher can kill it if torchrun dies first."""
    (out_dir / f"pid{os.environ.get(rank_env, '0')}").write_text(str(os.getpid()))


def kill_noted_ranks(out_dir: Path) -> None:
    import signal

    for path in out_dir.glob("pid*"):
        try:
            os.kill(int(path.read_text()), signal.SIGKILL)
        except (ValueError, ProcessLookupError, PermissionError):
            pass


# -- the training step the benchmarks time ------------------------------------------------
def mlp(hidden: int):
    """The benchmarks' model: three hidden x hidden linear layers with ReLUs between."""
    import torch.nn as nn

    return nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, hidden))


def bare_step(model, opt, x, y) -> None:
    """One MSE training step with no rankscope call."""
    import torch.nn.functional as F

    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def monitored_step(monitor, model, opt, x, y, lr: float | None = None) -> None:
    """The same step through the API a training loop uses: step, three phases, observe."""
    import torch.nn.functional as F

    with monitor.step(samples=len(x)) as s:
        with s.phase("forward"):
            loss = F.mse_loss(model(x), y)
        with s.phase("backward"):
            loss.backward()
        with s.phase("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        s.observe(loss=loss, lr=lr)
