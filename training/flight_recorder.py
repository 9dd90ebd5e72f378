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

    torch >= 2.7 records gloo and NCCL collectives alike once
    TORCH_FR_BUFFER_SIZE (or TORCH_NCCL_TRACE_BUFFER_SIZE) is > 0; older CUDA
    builds only have the NCCL entry point.
    """
    import torch

    c10d = torch._C._distributed_c10d
    dump = getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace", None)
    size = os.environ.get("TORCH_FR_BUFFER_SIZE") or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE") or "0"
    if dump is None or not size.isdigit() or int(size) <= 0:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"nccl_trace_rank_{rank}"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(dump(True, True, False))
    os.replace(tmp, path)
    return path
