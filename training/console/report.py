"""``rankscope report``: one self-contained HTML file about a run, from Prometheus's history of it.

Everything comes from PromQL over the report's window [start, end]: totals
are ``increase(...[window])`` evaluated at the end, time series are range
queries whose rate window follows Grafana's ``$__rate_interval`` rule (four
scrape intervals, at least two steps). Where the shipped recording rules say
what an alert judged (the straggler's peer ratio, the run's steps/s), the
report plots them, and falls back to the same expression written out when the
rules are not loaded. Plots are matplotlib figures (the Agg canvas, no
display) embedded as PNG data URIs, so the file opens anywhere with no
network; ``--png-dir`` also writes each one as a PNG.

The page ends with a JSON block (``<script type="application/json"
id="rankscope-report">``) holding the facts it shows (summary, straggler
ranking, points per plot) for scripts and tests.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import io
import json
import math
import re
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rankscope.console import evidence
from rankscope.console.sources import Prometheus, Series, SourceError, escape, parse_duration
from rankscope.console.view import histogram_quantile
from rankscope.contract.thresholds import STRAGGLER_PHASES as COMPUTE_PHASES
from rankscope.contract.thresholds import STRAGGLER_RATIO
from rankscope.contract.catalog import PHASES

MAX_POINTS = 240          # points per series in range queries: enough for a 1000-pixel-wide plot
MAX_LABELLED_RANKS = 40   # beyond this, every k-th rank is labelled on a per-rank axis
MAX_LEGEND = 16           # lines per plot that get a legend entry; a big run's lines stay unlabelled
MAX_RANKED_BARS = 30      # ranks drawn in the straggler bars (the slowest), all of them in the JSON
MAX_FIG_HEIGHT = 14.0     # inches: a 1,000-rank run still gives a readable page
PHASE_COLORS = {"data": "#e6b800", "forward": "#4c72b0", "backward": "#8172b3", "optimizer": "#55a868",
                "comm_wait": "#c44e52", "other": "#b0b0b0"}


@dataclass
class Plot:
    name: str            # file name stem and JSON key
    title: str
    png: bytes
    points: int          # data points drawn (0: the plot says it has nothing)
    caption: str = ""


@dataclass
class Written:
    html: Path
    pngs: list[Path] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)


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


def _utc(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _dur(seconds: float) -> str:
    return f"{int(math.ceil(max(seconds, 1.0)))}s"


def _finite(v: float) -> bool:
    return v is not None and not math.isnan(v) and not math.isinf(v)


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
        return result[0].value if result and _finite(result[0].value) else None

    def series(self, expr: str) -> list[tuple[dict[str, str], list[tuple[float, float]]]]:
        return self.p.query_range(expr, self.start, self.end, self.step)


def _rank_key(labels: dict[str, str]) -> int:
    try:
        return int(labels.get("rank", "-1"))
    except ValueError:
        return -1


# ---------------------------------------------------------------------------------------------- figures

def _figure(width: float = 10.0, height: float = 4.0):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _time_axis(ax, d: "RunData") -> None:
    """Every time plot spans the report's whole window, so they line up one above the other."""
    import matplotlib.dates as mdates

    ax.set_xlim(*_dates([d.start, d.end]))
    ax.xaxis.set_major_locator(mdates.AutoDateLocator())
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S", tz=dt.timezone.utc))
    ax.set_xlabel("time (UTC)")


def _dates(ts: list[float]):
    import matplotlib.dates as mdates

    return [mdates.date2num(dt.datetime.fromtimestamp(t, dt.timezone.utc)) for t in ts]


def _rank_height(count: int, per_rank: float, base: float = 1.2, least: float = 2.5) -> float:
    return min(MAX_FIG_HEIGHT, max(least, base + per_rank * count))


def _rank_ticks(ax, labels: list[str]) -> None:
    """Rank labels on the y axis: all of them, or every k-th for a big run."""
    every = max(1, math.ceil(len(labels) / MAX_LABELLED_RANKS))
    ax.set_yticks(range(0, len(labels), every), labels[::every], fontsize="small" if every > 1 else None)


def _legend(ax, count: int, **kwargs) -> None:
    if 0 < count <= MAX_LEGEND:
        ax.legend(fontsize="small", **kwargs)


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#888888")
    ax.set_xticks([])
    ax.set_yticks([])


def step_time_heatmap(d: RunData) -> Plot:
    import numpy as np

    expr = (f"sum by (rank) (rate(rankscope_step_duration_seconds_sum{{{d.sel}}}[{d.rate_window}]))"
            f" / sum by (rank) (rate(rankscope_step_duration_seconds_count{{{d.sel}}}[{d.rate_window}]) > 0)")
    rows = sorted(d.series(expr), key=lambda item: _rank_key(item[0]))
    fig = _figure(10, _rank_height(len(rows), 0.35))
    ax = fig.add_subplot()
    points = sum(1 for _, values in rows for _, v in values if _finite(v))
    if not points:
        _empty(ax, "no steps in this window")
    else:
        times = sorted({t for _, values in rows for t, _ in values})
        column = {t: i for i, t in enumerate(times)}
        grid = np.full((len(rows), len(times)), np.nan)
        for i, (_, values) in enumerate(rows):
            for t, v in values:
                if _finite(v):
                    grid[i, column[t]] = v * 1000
        edges = _dates([times[0] - d.step / 2] + [t + d.step / 2 for t in times])
        mesh = ax.pcolormesh(edges, np.arange(len(rows) + 1) - 0.5, np.ma.masked_invalid(grid), cmap="viridis",
                             shading="flat")
        ax.set_facecolor("#dddddd")   # no step completed there (a hang, or the rank not yet started)
        _rank_ticks(ax, [f"rank {labels.get('rank')}" for labels, _ in rows])
        ax.invert_yaxis()
        fig.colorbar(mesh, ax=ax, label="mean step time (ms)")
        _time_axis(ax, d)
    ax.set_title(f"Step time per rank (mean over {d.rate_window}; grey: no step completed)")
    return Plot("step_time_heatmap", "Step time per rank over time", _png(fig), points)


def phase_totals(d: RunData) -> dict[str, dict[str, float]]:
    """rank -> phase -> seconds per step over the window."""
    phases = d.total(f"sum by (rank, phase) (increase(rankscope_phase_seconds_total{{{d.sel}}}[{d.window}]))")
    steps = {s.labels.get("rank"): s.value
             for s in d.total(f"sum by (rank) (increase(rankscope_steps_total{{{d.sel}}}[{d.window}]))")}
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for s in phases:
        rank = s.labels.get("rank")
        if steps.get(rank) and _finite(s.value):
            out[rank][s.labels.get("phase", "other")] = s.value / steps[rank]
    return dict(out)


def phase_breakdown(per_rank: dict[str, dict[str, float]]) -> Plot:
    ranks = sorted(per_rank, key=lambda r: int(r))
    fig = _figure(10, _rank_height(len(ranks), 0.4))
    ax = fig.add_subplot()
    points = sum(1 for r in ranks for p in PHASES if per_rank[r].get(p, 0.0) > 0)
    if not points:
        _empty(ax, "no steps in this window")
    else:
        left = [0.0] * len(ranks)
        for phase in PHASES:
            widths = [per_rank[r].get(phase, 0.0) * 1000 for r in ranks]
            ax.barh(range(len(ranks)), widths, left=left, color=PHASE_COLORS[phase], label=phase)
            left = [a + b for a, b in zip(left, widths)]
        _rank_ticks(ax, [f"rank {r}" for r in ranks])
        ax.invert_yaxis()
        ax.set_xlabel("milliseconds per step (mean over the window)")
        ax.legend(ncols=len(PHASES), loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    return Plot("phase_breakdown", "Phase breakdown per rank", _png(fig), points)


def straggler_ranking(per_rank: dict[str, dict[str, float]], nodes: dict[str, str],
                      stages: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Ranks ordered by compute (forward + backward + optimizer) per step, as excess over the median of
    the ranks of their pipeline stage (``stages``: rank -> stage; a job without stages is one stage),
    as the straggler rule compares them: ranks of different stages do different work."""
    stages = stages or {}
    compute = {r: sum(p.get(ph, 0.0) for ph in COMPUTE_PHASES) for r, p in per_rank.items()}
    by_stage: dict[str, list[float]] = {}
    for r, c in compute.items():
        by_stage.setdefault(stages.get(r, ""), []).append(c)
    medians = {stage: statistics.median(values) for stage, values in by_stage.items()}
    ranking = []
    for r, c in compute.items():
        median = medians[stages.get(r, "")]
        ranking.append({"rank": int(r), "node": nodes.get(r, ""), "stage": stages.get(r, ""),
                        "compute_per_step_s": c, "excess_over_median": (c / median - 1.0) if median > 0 else 0.0,
                        "comm_wait_per_step_s": per_rank[r].get("comm_wait", 0.0),
                        "data_per_step_s": per_rank[r].get("data", 0.0)})
    ranking.sort(key=lambda x: (-x["excess_over_median"], x["rank"]))
    return ranking


def straggler_plot(d: RunData, ranking: list[dict[str, Any]]) -> Plot:
    """The ranking as bars, and beside it what the Straggler alert judged over time: each rank's compute per
    step over the median of its peers (recording rule rank:rankscope_phase_seconds:compute_per_step_peer_ratio)."""
    fig = _figure(10, 4.5)
    bars, line = fig.subplots(1, 2, width_ratios=[1, 2])
    if ranking:
        shown = ranking[:MAX_RANKED_BARS]
        labels = [f"rank {x['rank']}" for x in shown]
        excess = [100 * x["excess_over_median"] for x in shown]
        bars.barh(labels, excess, color=["#c44e52" if e > 0 else "#4c72b0" for e in excess])
        bars.axvline(0, color="black", linewidth=0.8)
        bars.invert_yaxis()
        bars.set_xlabel("compute per step over the median (%)")
    else:
        _empty(bars, "no steps in this window")
    bars.set_title("Straggler ranking" + (f" (slowest {MAX_RANKED_BARS})" if len(ranking) > MAX_RANKED_BARS else ""))
    rule = f"rank:rankscope_phase_seconds:compute_per_step_peer_ratio{{{d.sel}}}"
    series = d.series(rule)
    source = "recording rule"
    if not series:   # the shipped rules are not loaded in this Prometheus: the same ratio written out
        compute = (f"(sum without (phase) (rate(rankscope_phase_seconds_total{{{d.sel},"
                   f'phase=~"forward|backward|optimizer"}}[{d.rate_window}]))'
                   f" / rate(rankscope_steps_total{{{d.sel}}}[{d.rate_window}]))")
        series = d.series(f"{compute} / on (run) group_left () quantile by (run) (0.5, {compute})")
        source = "computed (recording rules not loaded)"
    points = 0
    for labels, values in sorted(series, key=lambda item: _rank_key(item[0])):
        finite = [(t, v) for t, v in values if _finite(v)]
        points += len(finite)
        if finite:
            line.plot(_dates([t for t, _ in finite]), [v for _, v in finite], label=f"rank {labels.get('rank')}",
                      linewidth=1 if len(series) <= MAX_LEGEND else 0.5)
    if points:
        line.axhline(STRAGGLER_RATIO, color="#c44e52", linestyle="--", linewidth=1,
                     label=f"alert bar {STRAGGLER_RATIO}")
        _legend(line, len(series) + 1)
        line.set_ylabel("compute per step / peers' median")
        _time_axis(line, d)
    else:
        _empty(line, "no compute samples")
    line.set_title(f"Compute over peers' median ({source})")
    return Plot("straggler_ranking", "Straggler ranking", _png(fig), len(ranking) + points)


def loss_plot(d: RunData) -> Plot:
    fig = _figure(10, 4)
    ax = fig.add_subplot()
    points = 0
    losses = d.series(f"rankscope_loss{{{d.sel}}}")
    for labels, values in sorted(losses, key=lambda item: _rank_key(item[0])):
        finite = [(t, v) for t, v in values if _finite(v)]
        points += len(finite)
        if finite:
            ax.plot(_dates([t for t, _ in finite]), [v for _, v in finite], label=f"rank {labels.get('rank')}",
                    linewidth=1 if len(losses) <= MAX_LEGEND else 0.5)
    lr_points = 0
    lr = d.series(f"avg by (run) (rankscope_learning_rate{{{d.sel}}})")
    if lr:
        values = [(t, v) for t, v in lr[0][1] if _finite(v)]
        lr_points = len(values)
        if values:
            twin = ax.twinx()
            twin.plot(_dates([t for t, _ in values]), [v for _, v in values], color="black", linestyle="--",
                      linewidth=1, label="learning rate")
            twin.set_ylabel("learning rate")
            twin.legend(loc="upper right", fontsize="small")
    if points:
        ax.set_ylabel("loss")
        _legend(ax, len(losses), loc="upper left")
        _time_axis(ax, d)
    else:
        _empty(ax, "no loss reported")
    ax.set_title("Loss per rank, with the learning rate")
    return Plot("loss", "Loss per rank with the learning rate", _png(fig), points + lr_points)


def memory_plot(d: RunData) -> Plot:
    device_total = d.scalar(f"max(max_over_time(rankscope_device_memory_total_bytes{{{d.sel}}}[{d.window}]))") or 0
    panels = [("host", "rankscope_host_memory_rss_bytes", "rankscope_host_memory_limit_bytes", "resident set")]
    if device_total > 0:
        panels.insert(0, ("device", "rankscope_device_memory_reserved_bytes", "rankscope_device_memory_total_bytes",
                          "reserved by the caching allocator"))
    fig = _figure(10, 3.2 * len(panels))
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    points = 0
    for ax, (kind, used, limit, what) in zip(axes, panels):
        drawn = 0
        lines = d.series(f"{used}{{{d.sel}}}")
        for labels, values in sorted(lines, key=lambda item: _rank_key(item[0])):
            finite = [(t, v) for t, v in values if _finite(v)]
            drawn += len(finite)
            if finite:
                ax.plot(_dates([t for t, _ in finite]), [v / 2**30 for _, v in finite],
                        label=f"rank {labels.get('rank')}", linewidth=1 if len(lines) <= MAX_LEGEND else 0.5)
        peak_limit = d.scalar(f"min(min_over_time({limit}{{{d.sel}}}[{d.window}]) > 0)")
        if drawn:
            top = max(line.get_ydata().max() for line in ax.get_lines())
            if peak_limit and peak_limit / 2**30 < 4 * top:   # draw the limit when it is near enough to read
                ax.axhline(peak_limit / 2**30, color="#c44e52", linestyle="--", linewidth=1, label="limit")
            ax.set_ylabel("GiB")
            _legend(ax, len(lines) + 1, loc="upper left")
            _time_axis(ax, d)
            caption = f" (limit {peak_limit / 2**30:.1f} GiB)" if peak_limit else ""
        else:
            _empty(ax, f"no {kind} memory samples")
            caption = ""
        ax.set_title(f"{kind.capitalize()} memory per rank: {what}{caption}")
        points += drawn
    return Plot("memory", "Memory per rank", _png(fig), points)


def collective_distribution(d: RunData) -> tuple[Plot, list[dict[str, Any]]]:
    counts: dict[str, dict[float, float]] = defaultdict(dict)
    for s in d.total(f"sum by (op, le) (increase(rankscope_collective_duration_seconds_bucket{{{d.sel}}}[{d.window}]))"):
        if _finite(s.value):
            counts[s.labels.get("op", "?")][float(s.labels["le"])] = s.value
    ops = sorted(op for op, b in counts.items() if b.get(math.inf, 0) > 0)
    stats = []
    fig = _figure(10, min(MAX_FIG_HEIGHT * 2, max(3.0, 2.6 * len(ops))))
    axes = fig.subplots(max(len(ops), 1), 1, squeeze=False)[:, 0]
    points = 0
    for ax, op in zip(axes, ops):
        buckets = counts[op]
        edges = sorted(buckets)
        per_bucket = [buckets[le] - (buckets[edges[i - 1]] if i else 0.0) for i, le in enumerate(edges)]
        total = buckets[math.inf]
        labels = [(f">{_ms_label(edges[-2])}" if math.isinf(le) else f"<={_ms_label(le)}") for le in edges]
        ax.bar(range(len(edges)), [100 * c / total for c in per_bucket], color="#4c72b0")
        ax.set_xticks(range(len(edges)), labels, rotation=45, ha="right", fontsize="small")
        ax.set_ylabel("% of collectives")
        quantiles = {q: histogram_quantile(q, buckets) for q in (0.5, 0.9, 0.99)}
        ax.set_title(f"{op}: {total:.0f} collectives, p50 {_ms(quantiles[0.5])}, p90 {_ms(quantiles[0.9])}, "
                     f"p99 {_ms(quantiles[0.99])}")
        stats.append({"op": op, "count": total, "p50_s": quantiles[0.5], "p90_s": quantiles[0.9],
                      "p99_s": quantiles[0.99]})
        points += sum(1 for c in per_bucket if c > 0)
    if not ops:
        _empty(axes[0], "no collectives timed in this window")
    return Plot("collective_latency", "Collective latency distribution per op", _png(fig), points), stats


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.3g} ms"


def _ms_label(seconds: float) -> str:
    return f"{seconds * 1000:g}ms"


def alert_intervals(d: RunData) -> list[dict[str, Any]]:
    """Each alert (name, rank, severity) that fired, as its firing intervals, from the ALERTS series."""
    out = []
    for labels, values in d.series(f'ALERTS{{alertstate="firing",{d.sel}}}'):
        times = sorted(t for t, v in values if _finite(v))
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


def alerts_timeline(d: RunData, alerts: list[dict[str, Any]]) -> Plot:
    fig = _figure(10, min(MAX_FIG_HEIGHT, 2.2 + 0.35 * max(len({(a["alertname"], a["rank"]) for a in alerts}), 1)))
    rate_axis, bars = fig.subplots(2, 1, sharex=True, height_ratios=[1, 1.2])
    rule = d.series(f"run:rankscope_steps:rate{{{d.sel}}}")
    if not rule:
        rule = d.series(f"avg by (run) (rate(rankscope_steps_total{{{d.sel}}}[{d.rate_window}]))")
    rate_points = [(t, v) for t, v in (rule[0][1] if rule else []) if _finite(v)]
    if rate_points:
        rate_axis.plot(_dates([t for t, _ in rate_points]), [v for _, v in rate_points], color="black", linewidth=1)
    rate_axis.set_ylabel("steps/s")
    rate_axis.set_title("Run throughput and the alerts that fired")
    lanes = sorted({(a["alertname"], a["rank"]) for a in alerts}, key=lambda k: (k[0], k[1]))
    for a in alerts:
        lane = lanes.index((a["alertname"], a["rank"]))
        begin, end = _dates([a["from"], a["to"]])
        color = "#c44e52" if a["severity"] == "critical" else "#e6b800"
        bars.broken_barh([(begin, end - begin)], (lane - 0.4, 0.8), color=color)
        rate_axis.axvspan(begin, end, color=color, alpha=0.15)
    if lanes:
        bars.set_yticks(range(len(lanes)), [f"{n} rank {r}" if r else n for n, r in lanes], fontsize="small")
        bars.set_ylim(-0.6, len(lanes) - 0.4)
        bars.invert_yaxis()
    else:
        bars.text(0.5, 0.5, "no alert fired", ha="center", va="center", transform=bars.transAxes, color="#888888")
        bars.set_yticks([])
    _time_axis(bars, d)
    return Plot("alerts_timeline", "Alerts on the timeline", _png(fig), len(rate_points) + len(alerts))


# ---------------------------------------------------------------------------------------------- the page

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
        raise SourceError(f"run {run!r} not found in {p.url} between {_utc(searched)} and {_utc(end_at)} "
                          f"(runs it has: {shown})")
    margin = 2 * p.scrape_interval()
    begin = parse_time(start, now) if start else max(first[0].value - margin, end_at - lookback_s)
    finish = end_at if end else min(last[0].value + margin, now)
    if finish <= begin:
        raise SourceError(f"empty window: --from {_utc(begin)} is not before --to {_utc(finish)}")
    return begin, finish


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
                     key=lambda s: _rank_key(s.labels))
        where = f"{key[0]} group {key[1]}"
        if odd:
            lines.append(f"{where}: " + ", ".join(f"rank {s.labels.get('rank')} differed from step {s.value:.0f}"
                                                 for s in odd))
        else:
            lines.append(f"{where}: every judged check agreed (lowest agreement {g.value:.0%})")
    return lines


def summary(d: RunData, ranking: list[dict[str, Any]]) -> dict[str, Any]:
    w = d.window
    ranks = d.total(f"count by (rank, node) (last_over_time(rankscope_steps_total{{{d.sel}}}[{w}]))")
    info = d.total(f"max by (world_size) (last_over_time(rankscope_rank_info{{{d.sel}}}[{w}]))")
    steps = d.scalar(f"max(increase(rankscope_steps_total{{{d.sel}}}[{w}]))")
    last_step = d.scalar(f"max(last_over_time(rankscope_step{{{d.sel}}}[{w}]))")
    buckets = {float(s.labels["le"]): s.value for s in d.total(
        f"sum by (le) (increase(rankscope_step_duration_seconds_bucket{{{d.sel}}}[{w}]))") if _finite(s.value)}
    mean = d.scalar(f"sum(increase(rankscope_step_duration_seconds_sum{{{d.sel}}}[{w}]))"
                    f" / sum(increase(rankscope_step_duration_seconds_count{{{d.sel}}}[{w}]))")
    samples = d.scalar(f"sum(increase(rankscope_samples_total{{{d.sel}}}[{w}]))")
    goodput = d.total(f'{{__name__=~"rankscope_.*goodput.*",{d.sel}}}')
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
        "goodput": goodput[0].value if goodput else None,
        "final_states": {r: states[r] for r in sorted(states, key=int)},
        "slowest_rank": ranking[0]["rank"] if ranking else None,
        "replicas": replicas(d),
        "scrape_interval_s": d.scrape_s, "resolution_s": d.step, "rate_window": d.rate_window,
    }


CSS = """
body { font-family: -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; margin: 2em auto; max-width: 1040px;
       color: #222; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { font-size: 1.2em; margin-top: 1.8em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.92em; }
th, td { border: 1px solid #ccc; padding: 3px 9px; text-align: left; } th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
img { max-width: 100%; border: 1px solid #eee; } .note { color: #666; font-size: 0.9em; }
"""


def _fmt_s(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.1f} ms" if v < 1 else f"{v:.2f} s"


def render_html(facts: dict[str, Any], plots: list[Plot]) -> str:
    s = facts["summary"]
    e = html.escape
    rows = [
        ("window", f"{_utc(s['from'])} to {_utc(s['to'])}"),
        ("duration", f"{s['duration_s'] / 60:.1f} min"),
        ("ranks", f"{s['ranks']} (world size {s['world_size'] or '?'}) on {len(s['nodes'])} node(s): "
                  f"{', '.join(s['nodes'])}"),
        ("steps", f"{s['steps']:.0f} per rank in the window (last step {s['last_step']:.0f})"
         if s["steps"] is not None and s["last_step"] is not None else "-"),
        ("median step time", f"{_fmt_s(s['median_step_time_s'])} (p90 {_fmt_s(s['p90_step_time_s'])}, "
                             f"mean {_fmt_s(s['mean_step_time_s'])})"),
        ("throughput", "-" if s["samples_per_s"] is None else f"{s['samples_per_s']:.1f} samples/s"),
        ("goodput", "-" if s["goodput"] is None else f"{s['goodput']:.3g}"),
        ("slowest rank (compute)", "-" if s["slowest_rank"] is None else f"rank {s['slowest_rank']}"),
        ("final states", ", ".join(f"rank {r}: {st}" for r, st in s["final_states"].items()) or "-"),
        ("replicas", "; ".join(s["replicas"]) or "none compared (nothing replicated, or the check off)"),
        ("alerts fired", str(len(facts["alerts"]))),
    ]
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>rankscope report: {e(s['run'])}"
             f"</title><style>{CSS}</style></head><body>",
             f"<h1>rankscope report: run <code>{e(s['run'])}</code></h1>",
             f"<p class='note'>From Prometheus at {e(facts['prometheus'])}, generated {e(_utc(facts['generated']))}; "
             f"resolution {s['resolution_s']:g} s, rates over {e(s['rate_window'])}.</p>",
             "<h2>Summary</h2><table>"]
    parts += [f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in rows]
    parts.append("</table>")
    by_name = {p.name: p for p in plots}

    def figure(name: str) -> str:
        p = by_name[name]
        data = base64.b64encode(p.png).decode()
        return f"<img alt='{e(p.title)}' src='data:image/png;base64,{data}'>"

    parts.append("<h2>Step time per rank over time</h2>" + figure("step_time_heatmap"))
    parts.append("<h2>Phase breakdown per rank</h2>" + figure("phase_breakdown"))
    staged = any(r["stage"] for r in facts["straggler_ranking"])
    parts.append("<h2>Straggler ranking</h2><p class='note'>Ranks ordered by compute (forward + backward + "
                 "optimizer) per step over the median of the ranks of their pipeline stage, across the whole "
                 "window. A rank that waits for a straggler shows it as comm wait, not compute.</p><table><tr>"
                 "<th>#</th><th>rank</th><th>node</th>" + ("<th>stage</th>" if staged else "") +
                 "<th>compute / step</th><th>over median</th><th>comm wait / step</th><th>data / step</th></tr>")
    for i, r in enumerate(facts["straggler_ranking"][:MAX_RANKED_BARS], 1):
        parts.append(f"<tr><td class='num'>{i}</td><td class='num'>{r['rank']}</td><td>{e(r['node'])}</td>"
                     + (f"<td class='num'>{e(r['stage'])}</td>" if staged else "") +
                     f"<td class='num'>{_fmt_s(r['compute_per_step_s'])}</td>"
                     f"<td class='num'>{100 * r['excess_over_median']:+.1f}%</td>"
                     f"<td class='num'>{_fmt_s(r['comm_wait_per_step_s'])}</td>"
                     f"<td class='num'>{_fmt_s(r['data_per_step_s'])}</td></tr>")
    more = len(facts["straggler_ranking"]) - MAX_RANKED_BARS
    parts.append("</table>" + (f"<p class='note'>{more} more ranks in the JSON at the end of this page.</p>"
                               if more > 0 else "") + figure("straggler_ranking"))
    parts.append("<h2>Loss per rank, with the learning rate</h2>" + figure("loss"))
    parts.append("<h2>Memory per rank</h2>" + figure("memory"))
    parts.append("<h2>Collective latency distribution per op</h2>" + figure("collective_latency"))
    parts.append("<h2>Alerts that fired</h2>" + figure("alerts_timeline"))
    if facts["alerts"]:
        parts.append("<table><tr><th>alert</th><th>severity</th><th>rank</th><th>firing from</th><th>to</th></tr>")
        for a in facts["alerts"]:
            parts.append(f"<tr><td>{e(a['alertname'])}</td><td>{e(a['severity'])}</td><td>{e(a['rank'])}</td>"
                         f"<td>{e(_utc(a['from']))}</td><td>{e(_utc(a['to']))}</td></tr>")
        parts.append("</table>")
    else:
        parts.append("<p>No alert fired in this window.</p>")
    parts.append("<h2>Evidence captured</h2>")
    if facts["evidence"]:
        parts.append("<p class='note'>Captured by the node exporters when a rank stopped making progress or "
                     "raised: its stacks, collectives, process and device state.</p><table><tr><th>rank</th>"
                     "<th>node</th><th>why</th><th>captured</th><th>where it was</th><th>link</th></tr>")
        for c in facts["evidence"]:
            said = evidence.one_line(c)
            parts.append(f"<tr><td class='num'>{c['rank']}</td><td>{e(c['node'])}</td><td>{e(c['trigger'])}</td>"
                         f"<td>{e(_utc(c['captured_at']))}</td><td>{e(said)}</td>"
                         f"<td><a href='{e(c['url'])}'>{e(c['url'])}</a></td></tr>")
        parts.append("</table>")
    else:
        parts.append("<p>No evidence was captured in this window: no rank stalled or raised.</p>")
    blob = json.dumps(facts, default=str).replace("</", "<\\/")
    parts.append(f"<script type='application/json' id='rankscope-report'>{blob}</script></body></html>")
    return "\n".join(parts)


def write_report(prometheus_url: str, run: str, out: Path, *, start: str | None = None, end: str | None = None,
                 lookback: str = "7d", png_dir: Path | None = None) -> Written:
    import matplotlib

    matplotlib.use("Agg")   # no display: a report is written on headless nodes and in CI
    p = Prometheus(prometheus_url)
    p.check()
    begin, finish = resolve_window(p, run, start, end, lookback)
    d = RunData(p, run, begin, finish)
    per_rank = phase_totals(d)
    nodes = {s.labels.get("rank"): s.labels.get("node", "")
             for s in d.total(f"last_over_time(rankscope_steps_total{{{d.sel}}}[{d.window}])")}
    stages = {s.labels.get("rank"): s.labels.get("stage", "")
              for s in d.total(f"last_over_time(rankscope_rank_layout_info{{{d.sel}}}[{d.window}]) == 1")}
    ranking = straggler_ranking(per_rank, nodes, stages)
    alerts = alert_intervals(d)
    captured = evidence_captured(d)
    collectives_plot, collective_stats = collective_distribution(d)
    plots = [step_time_heatmap(d), phase_breakdown(per_rank), straggler_plot(d, ranking), loss_plot(d),
             memory_plot(d), collectives_plot, alerts_timeline(d, alerts)]
    facts = {
        "prometheus": p.url, "generated": time.time(),
        "summary": summary(d, ranking),
        "straggler_ranking": ranking,
        "phases_per_step_s": per_rank,
        "collectives": collective_stats,
        "alerts": alerts,
        "evidence": captured,
        "plots": {pl.name: {"title": pl.title, "points": pl.points} for pl in plots},
    }
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(render_html(facts, plots), encoding="utf-8")
        written = Written(out, facts=facts)
        if png_dir is not None:
            png_dir.mkdir(parents=True, exist_ok=True)
            for pl in plots:
                path = png_dir / f"{pl.name}.png"
                path.write_bytes(pl.png)
                written.pngs.append(path)
    except OSError as e:
        raise SourceError(f"cannot write the report: {e}") from None
    return written
