"""One picture of a run: a row per rank, built from the series the exporter serves.

The same builder serves both sources (an exporter's ``/metrics`` or a
Prometheus instant query), because both give the catalog's series with the
identity labels (run, rank, local_rank, node): one record per rank
(``rankscope.pages.record``), its phase shares and medians ``rankscope.pages.figures``'.
Rates and medians need two points in time: ``build_view`` takes the samples now
and, when there is one, a baseline from ``window`` seconds earlier; without it
(``top --once`` on an exporter, or a rank that has not stepped since the baseline)
it falls back to the totals since the rank started, and says so
(``RankRow.since_start``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable

from rankscope.console.replicas import ReplicaGroup, replica_groups
from rankscope.console.sources import Series, SourceError
from rankscope.contract.states import ENDED_STATES, LIVE_STATES, RANK_STATES
from rankscope.pages.figures import histogram_quantile, phase_shares
from rankscope.pages.record import RankRecord, records


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


def runs_in(samples: Iterable[Series]) -> list[str]:
    return sorted(records(samples))


def choose_run(samples: list[Series], requested: str | None, where: str) -> str:
    """The requested run (or an error naming the runs there are), else the most recently active live run."""
    by_run = records(samples)
    if requested is not None:
        if requested not in by_run:
            known = ", ".join(sorted(by_run)) or "none"
            raise SourceError(f"run {requested!r} not found at {where} (runs there: {known})")
        return requested
    if not by_run:
        raise SourceError(f"no runs at {where}: no rank has registered yet")

    def activity(run: str) -> tuple[bool, float]:
        ranks = by_run[run].values()
        live = any(r.state in LIVE_STATES for r in ranks)   # a rank that still belongs to the running job
        newest = max((r.step_ts or r.start_ts or 0.0) for r in ranks)
        return live, newest

    return max(by_run, key=activity)


def _window(now: dict, before: dict | None) -> dict | None:
    """Per-key increase between two snapshots of counters; None when there is no baseline or a reset."""
    if before is None:
        return None
    delta = {k: v - before.get(k, 0.0) for k, v in now.items()}
    return None if any(d < 0 for d in delta.values()) else delta


def build_view(run: str, now: list[Series], *, source: str, baseline: list[Series] | None = None,
               window_s: float | None = None, alerts: list[Series] | None = None,
               taken_at: float | None = None) -> RunView:
    taken_at = time.time() if taken_at is None else taken_at
    current = records(now).get(run, {})
    before = records(baseline).get(run, {}) if baseline is not None else {}
    rows: list[RankRow] = []
    rates: list[float] = []
    for rank, r in sorted(current.items()):
        row = RankRow(run=run, rank=rank, node=r.node)
        row.state = r.state if r.state in RANK_STATES else "unknown"
        row.up = r.up if r.up is not None else True
        row.suspect = r.hang_suspect
        row.exception = r.exception
        row.evidence = r.evidence
        row.stage = r.stage
        row.step = r.step
        row.last_step_s = r.last_step_s
        row.stalled_s = r.stalled_s
        row.loss = r.loss
        row.grad_norm = r.grad_norm
        row.lr = r.lr

        # A rank missing from a baseline started after it: its counters were 0 then.
        old = before.get(rank, RankRecord()) if baseline is not None else None
        steps_now = r.steps
        steps_before = (old.steps or 0.0) if old is not None else None
        stepped = (steps_now is not None and steps_before is not None and steps_now > steps_before)
        if stepped and window_s:
            rates.append((steps_now - steps_before) / window_s)
        elif steps_now is not None and steps_before is not None and steps_now == steps_before and window_s:
            rates.append(0.0)

        recent_buckets = _window(r.buckets, old.buckets if old is not None else None)
        recent_phases = _window(r.phases, old.phases if old is not None else None)
        if stepped and recent_buckets is not None and recent_phases is not None:
            row.median_step_s = histogram_quantile(0.5, recent_buckets)
            row.phase_fractions = phase_shares(recent_phases)
        else:   # no step in the window (a hang, or no baseline): what the rank did since it started
            row.since_start = True
            row.median_step_s = histogram_quantile(0.5, r.buckets)
            row.phase_fractions = phase_shares(r.phases)

        if (r.device_memory_total or 0.0) > 0:
            row.memory_kind, row.memory_limit = "device", r.device_memory_total
            row.memory_used = r.device_memory_reserved
        else:
            row.memory_kind, row.memory_limit = "host", r.host_memory_limit
            row.memory_used = r.host_memory_rss

        # The exporter's age is 0 where its evidence found the rank outside the collective it counts itself in.
        ages = r.in_flight_s
        in_flight = [op for op, v in r.in_flight.items() if v >= 1 and ages.get(op, 1.0) > 0]
        if in_flight and row.state not in ENDED_STATES:
            started = r.collective_started
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
