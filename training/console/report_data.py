"""The run's history as ``rankscope report`` reads it from Prometheus: its window, the queries of
one report (``RunData``), and the facts the page shows (summary, straggler ranking, alerts,
evidence, replicas).

The figures are ``rankscope.pages.figures``', the alert rules' own: compute per step over the
median of the rank's peers (its stage without the slowest), goodput as productive wall seconds
over all of them, comm-bound and input-bound past the rules' bars.
"""

from __future__ import annotations

import datetime as dt
import math
import re
import time
from collections import defaultdict
from typing import Any

from rankscope.console import evidence
from rankscope.console.sources import Prometheus, Series, SourceError, escape, parse_duration
from rankscope.pages.figures import bound, compute_seconds, finite, goodput_promql, histogram_quantile, peer_ratios

MAX_POINTS = 240          # points per series in range queries: enough for a 1000-pixel-wide plot


def parse_time(text: str, now: float) -> float:
    """Unix seconds, ISO 8601 (naive means UTC), or ``now`` / ``now-2h``."""
    text = text.strip()
    match = re.fullmatch(r"now(?:\s*-\s*(\S+))?", text)
    if match:
        try:
            return now - (parse_duration(match.group(1)) if match.group(1) else 0.0)
        except ValueError:
            raise SourceError(f"bad time {text!r}: the duration after now- is not like 30m, 2h or 1d") from None
    try:
        return float(text)
    except ValueError:
        pass
    try:
        stamp = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise SourceError(f"bad time {text!r}: give unix seconds, ISO 8601 or now-DURATION") from None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=dt.timezone.utc)
    return stamp.timestamp()


def utc(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _dur(seconds: float) -> str:
    return f"{int(math.ceil(max(seconds, 1.0)))}s"


class RunData:
    """The queries of one report: run, window, resolution."""

    def __init__(self, prometheus: Prometheus, run: str, start: float, end: float):
        self.p = prometheus
        self.run = run
        self.sel = f'run="{escape(run)}"'
        self.start, self.end = start, end
        self.window = _dur(end - start)
        scrape = prometheus.scrape_interval()
        self.scrape_s = scrape
        self.step = max(scrape, math.ceil((end - start) / MAX_POINTS))
        self.rate_window = _dur(max(4 * scrape, 2 * self.step))

    def total(self, expr: str) -> list:
        """An instant query at the window's end."""
        return self.p.query(expr, self.end)

    def scalar(self, expr: str) -> float | None:
        result = self.total(expr)
        return result[0].value if result and finite(result[0].value) else None

    def series(self, expr: str) -> list[tuple[dict[str, str], list[tuple[float, float]]]]:
        return self.p.query_range(expr, self.start, self.end, self.step)


def rank_key(labels: dict[str, str]) -> int:
    try:
        return int(labels.get("rank", "-1"))
    except ValueError:
        return -1


def resolve_window(p: Prometheus, run: str, start: str | None, end: str | None, lookback: str) -> tuple[float, float]:
    """The report's [start, end]: as given, else from the run's first start to its last sign of life."""
    now = time.time()
    try:
        lookback_s = parse_duration(lookback)
    except ValueError:
        raise SourceError(f"bad --lookback {lookback!r}: give a duration like 6h or 7d") from None
    end_at = parse_time(end, now) if end else now
    sel = f'run="{escape(run)}"'
    window = _dur(lookback_s if not start else max(end_at - parse_time(start, now), 1.0))
    first = p.query(f"min(min_over_time(rankscope_rank_start_timestamp_seconds{{{sel}}}[{window}]))", end_at)
    last = p.query(f"max(max_over_time(rankscope_heartbeat_timestamp_seconds{{{sel}}}[{window}]))"
                   f" or max(max_over_time(rankscope_last_step_timestamp_seconds{{{sel}}}[{window}]))", end_at)
    if not first or not last:
        known = p.label_values("run", "rankscope_rank_info")
        shown = ", ".join(known[-10:]) if known else "none"
        searched = end_at - (lookback_s if not start else max(end_at - parse_time(start, now), 1.0))
        raise SourceError(f"run {run!r} not found in {p.url} between {utc(searched)} and {utc(end_at)} "
                          f"(runs it has: {shown})")
    margin = 2 * p.scrape_interval()
    begin = parse_time(start, now) if start else max(first[0].value - margin, end_at - lookback_s)
    finish = end_at if end else min(last[0].value + margin, now)
    if finish <= begin:
        raise SourceError(f"empty window: --from {utc(begin)} is not before --to {utc(finish)}")
    return begin, finish


def phase_totals(d: RunData) -> dict[str, dict[str, float]]:
    """rank -> phase -> seconds per step over the window."""
    phases = d.total(f"sum by (rank, phase) (increase(rankscope_phase_seconds_total{{{d.sel}}}[{d.window}]))")
    steps = {s.labels.get("rank"): s.value
             for s in d.total(f"sum by (rank) (increase(rankscope_steps_total{{{d.sel}}}[{d.window}]))")}
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for s in phases:
        rank = s.labels.get("rank")
        if steps.get(rank) and finite(s.value):
            out[rank][s.labels.get("phase", "other")] = s.value / steps[rank]
    return dict(out)


def straggler_ranking(per_rank: dict[str, dict[str, float]], nodes: dict[str, str],
                      stages: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Ranks ordered by compute (forward + backward + optimizer) per step over the median of their
    peers, as the straggler rule compares them (figures.peer_ratios): the ranks of their pipeline
    stage (``stages``: rank -> stage; a job without stages is one stage; ranks of different stages
    do different work) without the stage's slowest. A rank without peers (alone in its stage) has
    no ratio, and comes after those that have one, by its compute."""
    stages = stages or {}
    compute = {r: compute_seconds(p) for r, p in per_rank.items()}
    ratios = peer_ratios({r: c for r, c in compute.items() if c is not None}, stages)
    ranking = []
    for r, c in compute.items():
        ratio = ratios.get(r)
        ranking.append({"rank": int(r), "node": nodes.get(r, ""), "stage": stages.get(r, ""),
                        "compute_per_step_s": c, "peer_ratio": ratio,
                        "excess_over_peers": None if ratio is None else ratio - 1.0,
                        "comm_wait_per_step_s": per_rank[r].get("comm_wait", 0.0),
                        "data_per_step_s": per_rank[r].get("data", 0.0)})
    ranking.sort(key=lambda x: ((0, -x["peer_ratio"]) if x["peer_ratio"] is not None
                                else (1, -(x["compute_per_step_s"] or 0.0)), x["rank"]))
    return ranking


def alert_intervals(d: RunData) -> list[dict[str, Any]]:
    """Each alert (name, rank, severity) that fired, as its firing intervals, from the ALERTS series."""
    out = []
    for labels, values in d.series(f'ALERTS{{alertstate="firing",{d.sel}}}'):
        times = sorted(t for t, v in values if finite(v))
        spans: list[list[float]] = []
        for t in times:
            if spans and t - spans[-1][1] <= 1.5 * d.step:
                spans[-1][1] = t
            else:
                spans.append([t, t])
        for begin, end in spans:
            out.append({"alertname": labels.get("alertname", "?"), "severity": labels.get("severity", ""),
                        "rank": labels.get("rank", ""), "from": begin, "to": end + d.step})
    out.sort(key=lambda a: (a["from"], a["alertname"], a["rank"]))
    return out


def evidence_captured(d: RunData) -> list[dict[str, Any]]:
    """The evidence node exporters captured of the run's stalled or failed ranks in the window,
    each fetched from its exporter where it still answers (it keeps them as long as the run's
    files: retention)."""
    found = d.total(f"last_over_time({evidence.SERIES}{{{d.sel}}}[{d.window}])")   # the name is dropped
    named = [Series(evidence.SERIES, s.labels, s.value) for s in found]
    return evidence.summarize(evidence.captures(named, d.run))


def replicas(d: RunData) -> list[str]:
    """One line per replica group compared in the window (rankscope.replicas): the ranks that left
    it and from which check step, or that its replicas agreed at every check judged."""
    w = d.window
    lines = []
    groups = d.total(f"min by (replicas, group) (min_over_time(group:rankscope_replica_ranks:agreement_ratio"
                     f"{{{d.sel}}}[{w}]))")
    differed = d.total(f"min by (replicas, group, rank) (min_over_time("
                       f"rank_check:rankscope_replica_fingerprint:differs_at_step{{{d.sel}}}[{w}]))")
    for g in sorted(groups, key=lambda s: (s.labels.get("replicas", ""), s.labels.get("group", ""))):
        key = (g.labels.get("replicas"), g.labels.get("group"))
        odd = sorted((s for s in differed if (s.labels.get("replicas"), s.labels.get("group")) == key),
                     key=lambda s: rank_key(s.labels))
        where = f"{key[0]} group {key[1]}"
        if odd:
            lines.append(f"{where}: " + ", ".join(f"rank {s.labels.get('rank')} differed from step {s.value:.0f}"
                                                 for s in odd))
        else:
            lines.append(f"{where}: every judged check agreed (lowest agreement {g.value:.0%})")
    return lines


def summary(d: RunData, ranking: list[dict[str, Any]], per_rank: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The page's summary table. ``per_rank``: phase_totals(d), whose shares say which ranks were
    input- or comm-bound over the window."""
    w = d.window
    ranks = d.total(f"count by (rank, node) (last_over_time(rankscope_steps_total{{{d.sel}}}[{w}]))")
    info = d.total(f"max by (world_size) (last_over_time(rankscope_rank_info{{{d.sel}}}[{w}]))")
    steps = d.scalar(f"max(increase(rankscope_steps_total{{{d.sel}}}[{w}]))")
    last_step = d.scalar(f"max(last_over_time(rankscope_step{{{d.sel}}}[{w}]))")
    buckets = {float(s.labels["le"]): s.value for s in d.total(
        f"sum by (le) (increase(rankscope_step_duration_seconds_bucket{{{d.sel}}}[{w}]))") if finite(s.value)}
    mean = d.scalar(f"sum(increase(rankscope_step_duration_seconds_sum{{{d.sel}}}[{w}]))"
                    f" / sum(increase(rankscope_step_duration_seconds_count{{{d.sel}}}[{w}]))")
    samples = d.scalar(f"sum(increase(rankscope_samples_total{{{d.sel}}}[{w}]))")
    # Over the whole window, the ranks pooled (the sink's goodput, the rules' productive seconds): the
    # recorded run:rankscope_goodput:ratio is a 5-minute rate that leaves finished ranks out, so at the
    # end of a finished run, which is when a report is written, it has no sample.
    goodput = d.scalar(goodput_promql(d.sel, w))
    states = {s.labels.get("rank"): s.labels.get("state")
              for s in d.total(f"last_over_time(rankscope_rank_state{{{d.sel}}}[{w}]) == 1")}
    return {
        "run": d.run,
        "from": d.start, "to": d.end, "duration_s": d.end - d.start,
        "ranks": len(ranks),
        "nodes": sorted({s.labels.get("node", "") for s in ranks}),
        "world_size": info[0].labels.get("world_size") if info else None,
        "steps": steps, "last_step": last_step,
        "median_step_time_s": histogram_quantile(0.5, buckets),
        "p90_step_time_s": histogram_quantile(0.9, buckets),
        "mean_step_time_s": mean,
        "samples_per_s": samples / (d.end - d.start) if samples is not None else None,
        "goodput": goodput,
        "final_states": {r: states[r] for r in sorted(states, key=int)},
        "slowest_rank": ranking[0]["rank"] if ranking else None,
        "bottlenecks": {r: b for r in sorted(per_rank, key=int) if (b := bound(per_rank[r]))},
        "replicas": replicas(d),
        "scrape_interval_s": d.scrape_s, "resolution_s": d.step, "rate_window": d.rate_window,
    }


