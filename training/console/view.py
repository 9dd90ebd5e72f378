"""One picture of a run: a row per rank, built from the series the exporter serves.

The same builder serves both sources (an exporter's ``/metrics`` or a
Prometheus instant query), because both give the catalog's series with the
identity labels (run, rank, local_rank, node). Rates and medians need two
points in time: ``build_view`` takes the samples now and, when there is one,
a baseline from ``window`` seconds earlier; without it (``top --once`` on an
exporter, or a rank that has not stepped since the baseline) it falls back to
the totals since the rank started, and says so (``RankRow.since_start``).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable

from rankscope.console.replicas import ReplicaGroup, replica_groups
from rankscope.console.sources import Series, SourceError
from rankscope.contract.catalog import PHASES
from rankscope.exporter.catalog import LIVE_STATES, RANK_STATES

# States in which a rank still belongs to the running job (the default run is the one that has them).


@dataclass
class Alert:
    name: str
    severity: str
    rank: str


@dataclass
class RankRow:
    run: str
    rank: int
    node: str
    stage: str = ""                  # pipeline stage (rankscope_rank_layout_info), "" without stages
    state: str = "unknown"
    up: bool = True
    suspect: bool = False
    exception: str = ""
    step: float | None = None
    lag: float | None = None
    last_step_s: float | None = None
    median_step_s: float | None = None
    phase_fractions: dict[str, float] = field(default_factory=dict)
    loss: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    memory_used: float | None = None
    memory_limit: float | None = None
    memory_kind: str = ""            # "device" or "host"
    collective: str = ""             # op in flight, "" if none
    collective_age_s: float | None = None
    stalled_s: float | None = None
    since_start: bool = False        # median and phases are totals since start, not the window
    evidence: str = ""               # what its exporter captured evidence of it for (trigger), "" if nothing

    @property
    def comm_wait_fraction(self) -> float:
        return self.phase_fractions.get("comm_wait", 0.0)


@dataclass
class RunView:
    run: str
    source: str
    rows: list[RankRow]
    runs: list[str]
    taken_at: float
    window_s: float | None = None
    steps_per_s: float | None = None
    leader_step: float | None = None
    alerts: list[Alert] | None = None      # None: the source has no alerts (exporters)
    source_errors: list[str] = field(default_factory=list)   # exporters that did not answer this time
    evidence: list[dict] = field(default_factory=list)       # console.evidence.summarize() of the suspects
    replicas: list[ReplicaGroup] = field(default_factory=list)   # replica groups and their latest judged check

    def state_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for row in self.rows:
            counts[row.state] = counts.get(row.state, 0) + 1
        return {s: counts[s] for s in (*RANK_STATES, "unknown") if s in counts}

    @property
    def nodes(self) -> list[str]:
        return sorted({r.node for r in self.rows})

    @property
    def suspects(self) -> list[int]:
        return [r.rank for r in self.rows if r.suspect]


class _Rank:
    """The samples of one (run, rank), by name."""

    def __init__(self) -> None:
        self.by_name: dict[str, list[Series]] = defaultdict(list)

    def add(self, s: Series) -> None:
        self.by_name[s.name].append(s)

    def value(self, name: str, **labels: str) -> float | None:
        for s in self.by_name.get(name, ()):
            if all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
        return None

    def labelled(self, name: str, label: str) -> dict[str, float]:
        """label value -> sample value, summed over the other labels."""
        out: dict[str, float] = defaultdict(float)
        for s in self.by_name.get(name, ()):
            if label in s.labels:
                out[s.labels[label]] += s.value
        return dict(out)

    def labels(self) -> dict[str, str]:
        for samples in self.by_name.values():
            if samples:
                return samples[0].labels
        return {}


def index(samples: Iterable[Series]) -> dict[str, dict[str, _Rank]]:
    """run -> rank -> samples, for the series that carry a run and a rank."""
    out: dict[str, dict[str, _Rank]] = defaultdict(dict)
    for s in samples:
        run, rank = s.labels.get("run"), s.labels.get("rank")
        if run is None or rank is None:
            continue
        out[run].setdefault(rank, _Rank()).add(s)
    return out


def runs_in(samples: Iterable[Series]) -> list[str]:
    return sorted(index(samples))


def choose_run(samples: list[Series], requested: str | None, where: str) -> str:
    """The requested run (or an error naming the runs there are), else the most recently active live run."""
    by_run = index(samples)
    if requested is not None:
        if requested not in by_run:
            known = ", ".join(sorted(by_run)) or "none"
            raise SourceError(f"run {requested!r} not found at {where} (runs there: {known})")
        return requested
    if not by_run:
        raise SourceError(f"no runs at {where}: no rank has registered yet")

    def activity(run: str) -> tuple[bool, float]:
        ranks = by_run[run].values()
        live = any((r.value("rankscope_rank_state", state=s) or 0) >= 1 for r in ranks for s in LIVE_STATES)
        newest = max((r.value("rankscope_last_step_timestamp_seconds") or
                      r.value("rankscope_rank_start_timestamp_seconds") or 0.0) for r in ranks)
        return live, newest

    return max(by_run, key=activity)


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus's histogram_quantile on cumulative bucket counts {le: count}: linear within the bucket."""
    if not buckets:
        return None
    edges = sorted(buckets)
    total = buckets[edges[-1]]
    if not total or total <= 0 or not math.isinf(edges[-1]):
        return None
    target = q * total
    lower_edge, lower_count = 0.0, 0.0
    for le in edges:
        count = buckets[le]
        if count >= target:
            if math.isinf(le):
                return lower_edge   # in the open bucket: its lower bound, as Prometheus does
            if count == lower_count:
                return le
            return lower_edge + (le - lower_edge) * (target - lower_count) / (count - lower_count)
        lower_edge, lower_count = le, count
    return lower_edge


def _buckets(rank: _Rank, name: str) -> dict[float, float]:
    return {float(le): v for le, v in rank.labelled(name + "_bucket", "le").items()}


def _window(now: dict[str, float], before: dict[str, float] | None) -> dict[str, float] | None:
    """Per-key increase between two snapshots of counters; None when there is no baseline or a reset."""
    if before is None:
        return None
    delta = {k: v - before.get(k, 0.0) for k, v in now.items()}
    return None if any(d < 0 for d in delta.values()) else delta


def _fractions(values: dict[str, float]) -> dict[str, float]:
    total = sum(values.get(p, 0.0) for p in PHASES)
    return {p: values.get(p, 0.0) / total for p in PHASES} if total > 0 else {}


def build_view(run: str, now: list[Series], *, source: str, baseline: list[Series] | None = None,
               window_s: float | None = None, alerts: list[Series] | None = None,
               taken_at: float | None = None) -> RunView:
    taken_at = time.time() if taken_at is None else taken_at
    current = index(now).get(run, {})
    before = index(baseline).get(run, {}) if baseline is not None else {}
    rows: list[RankRow] = []
    rates: list[float] = []
    for rank_label, r in current.items():
        labels = r.labels()
        try:
            rank_number = int(rank_label)
        except ValueError:
            continue
        row = RankRow(run=run, rank=rank_number, node=labels.get("node", ""))
        states = [s for s in RANK_STATES if (r.value("rankscope_rank_state", state=s) or 0) >= 1]
        row.state = states[0] if states else "unknown"
        row.up = (r.value("rankscope_rank_up") or 0) >= 1 if r.value("rankscope_rank_up") is not None else True
        row.suspect = (r.value("rankscope_hang_suspect") or 0) >= 1
        failures = r.labelled("rankscope_rank_failure_info", "exception")
        row.exception = next((e for e, v in failures.items() if v >= 1), "")
        row.evidence = next(iter(r.labelled("rankscope_evidence_captured_timestamp_seconds", "trigger")), "")
        row.stage = next((st for st, v in r.labelled("rankscope_rank_layout_info", "stage").items() if v >= 1), "")
        row.step = r.value("rankscope_step")
        row.last_step_s = r.value("rankscope_step_last_duration_seconds")
        row.stalled_s = r.value("rankscope_step_stalled_seconds")
        row.loss = r.value("rankscope_loss")
        row.grad_norm = r.value("rankscope_grad_norm")
        row.lr = r.value("rankscope_learning_rate")

        # A rank missing from a baseline started after it: its counters were 0 then.
        old = before.get(rank_label, _Rank()) if baseline is not None else None
        steps_now = r.value("rankscope_steps_total")
        steps_before = (old.value("rankscope_steps_total") or 0.0) if old is not None else None
        stepped = (steps_now is not None and steps_before is not None and steps_now > steps_before)
        if stepped and window_s:
            rates.append((steps_now - steps_before) / window_s)
        elif steps_now is not None and steps_before is not None and steps_now == steps_before and window_s:
            rates.append(0.0)

        buckets_now = _buckets(r, "rankscope_step_duration_seconds")
        phases_now = r.labelled("rankscope_phase_seconds_total", "phase")
        recent_buckets = _window(buckets_now, _buckets(old, "rankscope_step_duration_seconds")
                                 if old is not None else None)
        recent_phases = _window(phases_now, old.labelled("rankscope_phase_seconds_total", "phase")
                                if old is not None else None)
        if stepped and recent_buckets is not None and recent_phases is not None:
            row.median_step_s = histogram_quantile(0.5, recent_buckets)
            row.phase_fractions = _fractions(recent_phases)
        else:   # no step in the window (a hang, or no baseline): what the rank did since it started
            row.since_start = True
            row.median_step_s = histogram_quantile(0.5, buckets_now)
            row.phase_fractions = _fractions(phases_now)

        device_total = r.value("rankscope_device_memory_total_bytes") or 0.0
        if device_total > 0:
            row.memory_kind, row.memory_limit = "device", device_total
            row.memory_used = r.value("rankscope_device_memory_reserved_bytes")
        else:
            row.memory_kind, row.memory_limit = "host", r.value("rankscope_host_memory_limit_bytes")
            row.memory_used = r.value("rankscope_host_memory_rss_bytes")

        # The exporter's age is 0 where its evidence found the rank outside the collective it counts itself in.
        ages = r.labelled("rankscope_collective_in_flight_seconds", "op")
        in_flight = [op for op, v in r.labelled("rankscope_collective_in_flight", "op").items()
                     if v >= 1 and ages.get(op, 1.0) > 0]
        if in_flight and row.state not in ("dead", "finished"):
            started = r.labelled("rankscope_collective_started_timestamp_seconds", "op")
            op = max(in_flight, key=lambda o: ages.get(o, 0.0))
            row.collective = op
            row.collective_age_s = ages.get(op) if op in ages else (
                max(taken_at - started[op], 0.0) if started.get(op) else None)
        rows.append(row)

    steps = [r.step for r in rows if r.step is not None]
    leader = max(steps) if steps else None
    for row in rows:
        if row.step is not None and leader is not None:
            row.lag = leader - row.step
    rows.sort(key=lambda r: r.rank)
    firing = None
    if alerts is not None:
        firing = sorted((Alert(a.labels.get("alertname", "?"), a.labels.get("severity", ""), a.labels.get("rank", ""))
                         for a in alerts), key=lambda a: (a.severity != "critical", a.name, a.rank))
    return RunView(run=run, source=source, rows=rows, runs=runs_in(now), taken_at=taken_at,
                   window_s=window_s if baseline is not None else None,
                   steps_per_s=(sum(rates) / len(rates)) if rates else None, leader_step=leader, alerts=firing,
                   replicas=replica_groups(now, run))
