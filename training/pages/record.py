"""One record per rank: the series of one rank of one run, as every reader takes them.

An exporter's page and a Prometheus instant query of the same series give the same samples
(the catalog's names, the identity labels run, rank, local_rank, node), so ``rankscope top``
(from either), and rank 0's TensorBoard / MLflow sink (from the pages) read them into the
same record. Counters are totals since the rank's process started: readers take increases
between two records (``rankscope.pages.figures.delta``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

from rankscope.contract.states import RANK_STATES
from rankscope.pages.exposition import Series

EVIDENCE_SERIES = "rankscope_evidence_captured_timestamp_seconds"


@dataclass
class RankRecord:
    """One rank's series from one scrape; absent series stay None (or empty, or 0 for the event counts)."""

    run: str = ""
    rank: int = -1
    node: str = ""
    stage: str = ""                      # its pipeline stage now (rankscope_rank_layout_info), "" without stages
    # steps
    steps: float | None = None           # rankscope_steps_total
    step: float | None = None            # rankscope_step: the global step of its last completed step
    step_ts: float | None = None         # rankscope_last_step_timestamp_seconds
    start_ts: float | None = None        # rankscope_rank_start_timestamp_seconds
    last_step_s: float | None = None     # rankscope_step_last_duration_seconds
    stalled_s: float | None = None       # rankscope_step_stalled_seconds (the exporter's)
    dur_sum: float | None = None         # rankscope_step_duration_seconds_sum
    dur_count: float | None = None       # rankscope_step_duration_seconds_count
    buckets: dict[float, float] = field(default_factory=dict)   # its cumulative buckets, le -> count
    phases: dict[str, float] = field(default_factory=dict)      # rankscope_phase_seconds_total, phase -> s
    # values and events
    loss: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    nonfinite: float = 0.0               # rankscope_nonfinite_total, loss and grad together
    oom: float = 0.0
    flops: float | None = None           # rankscope_model_flops_total
    peak_flops: float | None = None      # rankscope_device_peak_flops
    wall: dict[str, float] = field(default_factory=dict)        # rankscope_wall_seconds_total, category -> s
    # its process and state, as the exporter judges them
    pids: frozenset[str] = frozenset()   # process_id of each rankscope_rank_info (a restart adds one)
    state: str | None = None             # the state of rankscope_rank_state == 1; None: no state series
    up: bool | None = None               # rankscope_rank_up; None: no such series
    hang_suspect: bool = False
    exception: str = ""                  # rankscope_rank_failure_info's exception, "" if it raised nothing
    evidence: str = ""                   # the trigger of the evidence its exporter captured, "" if none
    # memory
    device_memory_total: float | None = None
    device_memory_reserved: float | None = None
    host_memory_limit: float | None = None
    host_memory_rss: float | None = None
    # collectives, op -> value
    in_flight: dict[str, float] = field(default_factory=dict)           # rankscope_collective_in_flight
    in_flight_s: dict[str, float] = field(default_factory=dict)         # rankscope_collective_in_flight_seconds
    collective_started: dict[str, float] = field(default_factory=dict)  # ..._started_timestamp_seconds


# Series of one value per rank: the record's attribute.
_VALUES = {
    "rankscope_steps_total": "steps", "rankscope_last_step_timestamp_seconds": "step_ts",
    "rankscope_rank_start_timestamp_seconds": "start_ts", "rankscope_step_last_duration_seconds": "last_step_s",
    "rankscope_step_stalled_seconds": "stalled_s", "rankscope_step_duration_seconds_sum": "dur_sum",
    "rankscope_step_duration_seconds_count": "dur_count", "rankscope_loss": "loss", "rankscope_grad_norm": "grad_norm",
    "rankscope_learning_rate": "lr", "rankscope_model_flops_total": "flops", "rankscope_device_peak_flops": "peak_flops",
    "rankscope_device_memory_total_bytes": "device_memory_total",
    "rankscope_device_memory_reserved_bytes": "device_memory_reserved",
    "rankscope_host_memory_limit_bytes": "host_memory_limit", "rankscope_host_memory_rss_bytes": "host_memory_rss",
}
# Series of one value per label value: the record's dict (by that label), summed over the other labels.
_BY_LABEL = {
    "rankscope_phase_seconds_total": ("phases", "phase"),
    "rankscope_wall_seconds_total": ("wall", "category"),
    "rankscope_step_duration_seconds_bucket": ("buckets", "le"),
    "rankscope_collective_in_flight": ("in_flight", "op"),
    "rankscope_collective_in_flight_seconds": ("in_flight_s", "op"),
    "rankscope_collective_started_timestamp_seconds": ("collective_started", "op"),
}
# Event counters summed over their labels.
_COUNTS = {"rankscope_nonfinite_total": "nonfinite", "rankscope_oom_total": "oom"}
# Every series a record reads: a reader of a whole page asks for these (or fewer) lines.
SERIES = frozenset(_VALUES) | frozenset(_BY_LABEL) | frozenset(_COUNTS) | {
    "rankscope_step", "rankscope_rank_info", "rankscope_rank_state", "rankscope_rank_up", "rankscope_hang_suspect",
    "rankscope_rank_failure_info", "rankscope_rank_layout_info", EVIDENCE_SERIES,
}


def records(samples: Iterable[Series]) -> dict[str, dict[int, RankRecord]]:
    """run -> rank -> record, for the samples that carry a run and a (numeric) rank."""
    out: dict[str, dict[int, RankRecord]] = {}
    states: dict[int, set[str]] = {}
    for s in samples:
        run, label = s.labels.get("run"), s.labels.get("rank")
        if run is None or label is None:
            continue
        try:
            rank = int(label)
        except ValueError:
            continue
        by_rank = out.setdefault(run, {})
        r = by_rank.get(rank)
        if r is None:
            r = by_rank[rank] = RankRecord(run, rank, node=s.labels.get("node", ""))
        if s.name == "rankscope_rank_state":
            if s.value >= 1:
                states.setdefault(id(r), set()).add(s.labels.get("state", ""))
        else:
            _add(r, s)
    for by_rank in out.values():
        for r in by_rank.values():
            found = states.get(id(r), set())
            r.state = next((st for st in RANK_STATES if st in found), min(found) if found else None)
    return out


def run_records(samples: Iterable[Series], run: str) -> dict[int, RankRecord]:
    """rank -> record of one run."""
    return records(samples).get(run, {})


def _add(r: RankRecord, s: Series) -> None:
    name, labels, v = s.name, s.labels, float(s.value)
    if name in _VALUES:
        setattr(r, _VALUES[name], v)
    elif name in _BY_LABEL:
        attr, label = _BY_LABEL[name]
        if label in labels:
            key = float(labels[label]) if label == "le" else labels[label]
            values = getattr(r, attr)
            values[key] = values.get(key, 0.0) + v
    elif name in _COUNTS:
        setattr(r, _COUNTS[name], getattr(r, _COUNTS[name]) + v)
    elif name == "rankscope_step":   # the highest finite step, where a page lists more than one
        r.step = v if r.step is None or not math.isfinite(r.step) else max(r.step, v)
    elif name == "rankscope_rank_info":
        r.pids = r.pids | {labels.get("process_id", "")}
    elif name == "rankscope_rank_up":
        r.up = v >= 1
    elif name == "rankscope_hang_suspect":
        r.hang_suspect = r.hang_suspect or v >= 1
    elif name == "rankscope_rank_failure_info":
        if v >= 1 and not r.exception:
            r.exception = labels.get("exception", "")
    elif name == EVIDENCE_SERIES:
        r.evidence = r.evidence or labels.get("trigger", "")
    elif name == "rankscope_rank_layout_info":   # value 0 for a layout it no longer has
        if v >= 1:
            r.stage = labels.get("stage", "")
