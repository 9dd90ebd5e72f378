"""Hand-off to torch's flight recorder when a collective hangs.

Once a collective has been in flight for ``after_s``, the rank dumps torch's
flight recorder where the runbook says to look, once per stuck collective:
``<run dir>/flight-recorder/nccl_trace_rank_<rank>`` (the name torchfrtrace
expects; ``cpu_trace_rank_<rank>`` besides it for the gloo half of a job that
has both). It needs TORCH_FR_BUFFER_SIZE > 0 (or unset: 2000); 0 turns the
recorders off.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Mapping

from rankscope.contract.rundir import FLIGHT_RECORDER_SUBDIR

log = logging.getLogger("rankscope")

RING_DEFAULT = 2000   # entries torch keeps when neither variable is set (torch >= 2.11)


class FlightRecorder:
    def __init__(self, run_dir: Path, rank: int, after_s: float, ring: int = RING_DEFAULT):
        self._directory = run_dir / FLIGHT_RECORDER_SUBDIR
        self._rank = rank
        self._after_s = after_s
        self._ring = ring
        self._dumped_for = 0.0   # start of the collective last dumped for

    def check(self, oldest_start: float) -> None:
        """Called by the publisher with the start (unix) of the oldest collective in flight."""
        if time.time() - oldest_start < self._after_s or self._dumped_for == oldest_start:
            return
        self._dumped_for = oldest_start
        paths = dump_flight_recorder(self._directory, self._rank, self._ring)
        if paths:
            log.warning("rankscope: collective in flight for over %.0f s; flight recorder dumped to %s",
                        self._after_s, ", ".join(map(str, paths)))


def ring_size(env: Mapping[str, str] | None = None) -> int:
    """Entries torch's flight recorders keep: TORCH_FR_BUFFER_SIZE, else the older
    TORCH_NCCL_TRACE_BUFFER_SIZE, else torch's default. 0: the recorders are off."""
    env = os.environ if env is None else env
    raw = env.get("TORCH_FR_BUFFER_SIZE") or env.get("TORCH_NCCL_TRACE_BUFFER_SIZE") or str(RING_DEFAULT)
    return int(raw) if raw.strip().isdigit() else RING_DEFAULT


# Per recorder (rankscope.collectives.ring_source.RECORDERS): its status call, its pickle dump, and
# the file a hang writes it to. torchfrtrace reads nccl_trace_rank_<N>; the CPU recorder
# (gloo) takes that name when it is the only one with collectives.
_DUMPS = (("nccl", "_dump_nccl_trace_json", "_dump_nccl_trace", "nccl_trace_rank_"),
          ("cpu", "_dump_fr_trace_json", "_dump_fr_trace", "nccl_trace_rank_"))


def dump_flight_recorder(directory: Path, rank: int, ring: int | None = None) -> list[Path]:
    """Write each of torch's flight recorders that holds collectives (a pickle each) for this
    rank; [] where they are off or empty.

    torch >= 2.7 records every collective while TORCH_FR_BUFFER_SIZE (or
    TORCH_NCCL_TRACE_BUFFER_SIZE) is > 0, and keeps 2000 entries by default
    (since 2.11 at least). Whether a recorder holds anything is read from its
    status, not guessed from the version. ProcessGroupNCCL keeps its own
    recorder (CUDA builds): an NCCL job's collectives are only in that one.
    """
    import json

    import torch

    if (ring_size() if ring is None else ring) <= 0:
        return []
    c10d = torch._C._distributed_c10d
    written: list[Path] = []
    for name, status, dump, prefix in _DUMPS:
        if not hasattr(c10d, status) or not hasattr(c10d, dump):
            continue
        groups = json.loads(getattr(c10d, status)(False, False)).get("pg_status", {})
        if not any(int(s.get("last_enqueued_collective", -1)) >= 0 for s in groups.values()):
            continue
        if written:   # the NCCL recorder took torchfrtrace's name
            prefix = f"{name}_trace_rank_"
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{prefix}{rank}"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(getattr(c10d, dump)(True, True, False))
        os.replace(tmp, path)
        written.append(path)
    return written
