"""The plots of ``rankscope report``: matplotlib figures (the Agg canvas, no display) as PNG bytes.

Every time plot spans the report's whole window, so they line up one above the other.
"""

from __future__ import annotations

import datetime as dt
import io
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from rankscope.console.report_data import RunData, rank_key
from rankscope.contract.catalog import PHASES
from rankscope.contract.thresholds import STRAGGLER_RATIO
from rankscope.pages.figures import PEER_RATIO_RECORD, finite, histogram_quantile, peer_ratio_promql

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
    rows = sorted(d.series(expr), key=lambda item: rank_key(item[0]))
    fig = _figure(10, _rank_height(len(rows), 0.35))
    ax = fig.add_subplot()
    points = sum(1 for _, values in rows for _, v in values if finite(v))
    if not points:
        _empty(ax, "no steps in this window")
    else:
        times = sorted({t for _, values in rows for t, _ in values})
        column = {t: i for i, t in enumerate(times)}
        grid = np.full((len(rows), len(times)), np.nan)
        for i, (_, values) in enumerate(rows):
            for t, v in values:
                if finite(v):
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


def straggler_plot(d: RunData, ranking: list[dict[str, Any]]) -> Plot:
    """The ranking as bars, and beside it what the Straggler alert judged over time: each rank's compute per
    step over the median of its peers (the recording rule PEER_RATIO_RECORD, or its expression written out)."""
    fig = _figure(10, 4.5)
    bars, line = fig.subplots(1, 2, width_ratios=[1, 2])
    if ranking:
        shown = ranking[:MAX_RANKED_BARS]
        labels = [f"rank {x['rank']}" for x in shown]
        excess = [100 * (x["excess_over_peers"] or 0.0) for x in shown]   # no peers: drawn at 0
        bars.barh(labels, excess, color=["#c44e52" if e > 0 else "#4c72b0" for e in excess])
        bars.axvline(0, color="black", linewidth=0.8)
        bars.invert_yaxis()
        bars.set_xlabel("compute per step over its peers' median (%)")
    else:
        _empty(bars, "no steps in this window")
    bars.set_title("Straggler ranking" + (f" (slowest {MAX_RANKED_BARS})" if len(ranking) > MAX_RANKED_BARS else ""))
    series = d.series(f"{PEER_RATIO_RECORD}{{{d.sel}}}")
    source = "recording rule"
    if not series:   # the shipped rules are not loaded in this Prometheus: the same ratio written out
        series = d.series(peer_ratio_promql(d.sel, d.rate_window))
        source = "computed (recording rules not loaded)"
    points = _plot_per_rank(line, series)
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


def _plot_per_rank(ax, series: list) -> int:
    """One line per rank, in rank order, of its finite values; the number of points drawn."""
    points = 0
    for labels, values in sorted(series, key=lambda item: rank_key(item[0])):
        kept = [(t, v) for t, v in values if finite(v)]
        points += len(kept)
        if kept:
            ax.plot(_dates([t for t, _ in kept]), [v for _, v in kept], label=f"rank {labels.get('rank')}",
                    linewidth=1 if len(series) <= MAX_LEGEND else 0.5)
    return points


def loss_plot(d: RunData) -> Plot:
    fig = _figure(10, 4)
    ax = fig.add_subplot()
    losses = d.series(f"rankscope_loss{{{d.sel}}}")
    points = _plot_per_rank(ax, losses)
    lr_points = 0
    lr = d.series(f"avg by (run) (rankscope_learning_rate{{{d.sel}}})")
    if lr:
        values = [(t, v) for t, v in lr[0][1] if finite(v)]
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
        for labels, values in sorted(lines, key=lambda item: rank_key(item[0])):
            kept = [(t, v) for t, v in values if finite(v)]
            drawn += len(kept)
            if kept:
                ax.plot(_dates([t for t, _ in kept]), [v / 2**30 for _, v in kept],
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
        if finite(s.value):
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


def alerts_timeline(d: RunData, alerts: list[dict[str, Any]]) -> Plot:
    fig = _figure(10, min(MAX_FIG_HEIGHT, 2.2 + 0.35 * max(len({(a["alertname"], a["rank"]) for a in alerts}), 1)))
    rate_axis, bars = fig.subplots(2, 1, sharex=True, height_ratios=[1, 1.2])
    rule = d.series(f"run:rankscope_steps:rate{{{d.sel}}}")
    if not rule:
        rule = d.series(f"avg by (run) (rate(rankscope_steps_total{{{d.sel}}}[{d.rate_window}]))")
    rate_points = [(t, v) for t, v in (rule[0][1] if rule else []) if finite(v)]
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
