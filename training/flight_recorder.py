"""Hand-off to torch's flight recorder when a collective hangs.

Once a collective has been in flight for ``after_s``, the rank dumps torch's
flight recorder where the runbook says to look, once per stuck collective:
``<run dir>/flight-recorder/nccl_trace_rank_<rank>`` (the name torchfrtrace
expects). It needs TORCH_FR_BUFFER_SIZE > 0; the recorder is off otherwise.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

log = logging.getLogger("rankscope")


class FlightRecorder:
    def __init__(self, run_dir: Path, rank: int, after_s: float):
        self._directory = run_dir / "flight-recorder"
        self._rank = rank
        self._after_s = after_s
        self._dumped_for = 0.0   # start of the collective last dumped for

    def check(self, oldest_start: float) -> None:
        """Called by the publisher with the start (unix) of the oldest collective in flight."""
        if time.time() - oldest_start < self._after_s or self._dumped_for == oldest_start:
            return
        self._dumped_for = oldest_start
        path = dump_flight_recorder(self._directory, self._rank)
        if path is not None:
            log.warning("rankscope: collective in flight for over %.0f s; flight recorder dumped to %s",
                        self._after_s, path)


def dump_flight_recorder(directory: Path, rank: int) -> Path | None:
    """Write torch's flight recorder (a pickle) for this rank; None where it is off or missing.

    torch >= 2.7 records gloo and NCCL collectives alike while
    TORCH_FR_BUFFER_SIZE (or TORCH_NCCL_TRACE_BUFFER_SIZE) is > 0; torch 2.13
    keeps 2000 entries when neither is set (older releases: none). Older CUDA
    builds only have the NCCL entry point.
    """
    import torch

    c10d = torch._C._distributed_c10d
    dump = getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace", None)
    size = os.environ.get("TORCH_FR_BUFFER_SIZE") or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE")
    if size is None:   # torch's own default: 2000 entries from 2.13 on (c10d FlightRecorder.hpp)
        size = "2000" if _torch_at_least(torch.__version__, (2, 13)) else "0"
    if dump is None or not size.strip().isdigit() or int(size) <= 0:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"nccl_trace_rank_{rank}"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(dump(True, True, False))
    os.replace(tmp, path)
    return path


def _torch_at_least(version: str, wanted: tuple[int, int]) -> bool:
    parts = version.split("+")[0].split(".")
    try:
        return (int(parts[0]), int(parts[1])) >= wanted
    except (IndexError, ValueError):
        return False
