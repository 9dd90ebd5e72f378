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

Its parts, by role: ``report_data`` (the window, the queries, the facts), ``report_plots``
(the figures) and ``report_html`` (the page); the figures' meaning is ``rankscope.pages.figures``'.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rankscope.console.report_data import (RunData, alert_intervals, evidence_captured, parse_time, phase_totals,
                                           resolve_window, straggler_ranking, summary)
from rankscope.console.report_html import render_html
from rankscope.console.report_plots import (alerts_timeline, collective_distribution, loss_plot, memory_plot,
                                            phase_breakdown, step_time_heatmap, straggler_plot)
from rankscope.console.sources import Prometheus, SourceError

__all__ = ["Written", "parse_time", "straggler_ranking", "write_report"]


@dataclass
class Written:
    html: Path
    pngs: list[Path] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)


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
        "summary": summary(d, ranking, per_rank),
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
