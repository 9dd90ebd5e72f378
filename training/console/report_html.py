"""The page of ``rankscope report``: one self-contained HTML file (plots embedded as PNG data
URIs, no network), ending with a JSON block of the facts it shows."""

from __future__ import annotations

import base64
import html
import json
from typing import Any

from rankscope.console import evidence
from rankscope.console.report_data import utc
from rankscope.console.report_plots import MAX_RANKED_BARS, Plot
from rankscope.contract.thresholds import COMM_BOUND_RATIO, INPUT_BOUND_RATIO
from rankscope.pages.figures import COMPUTE_PHASES

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


def _percent(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:+.1f}%"


def _bottlenecks(found: dict[str, str]) -> str:
    if not found:
        return (f"none: no rank's data wait over {INPUT_BOUND_RATIO:.0%} of its step time, nor its comm wait "
                f"over {COMM_BOUND_RATIO:.0%}")
    return ", ".join(f"rank {r}: {b}" for r, b in found.items())


def render_html(facts: dict[str, Any], plots: list[Plot]) -> str:
    s = facts["summary"]
    e = html.escape
    rows = [
        ("window", f"{utc(s['from'])} to {utc(s['to'])}"),
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
        ("bottlenecks", _bottlenecks(s["bottlenecks"])),
        ("final states", ", ".join(f"rank {r}: {st}" for r, st in s["final_states"].items()) or "-"),
        ("replicas", "; ".join(s["replicas"]) or "none compared (nothing replicated, or the check off)"),
        ("alerts fired", str(len(facts["alerts"]))),
    ]
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>rankscope report: {e(s['run'])}"
             f"</title><style>{CSS}</style></head><body>",
             f"<h1>rankscope report: run <code>{e(s['run'])}</code></h1>",
             f"<p class='note'>From Prometheus at {e(facts['prometheus'])}, generated {e(utc(facts['generated']))}; "
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
    parts.append(f"<h2>Straggler ranking</h2><p class='note'>Ranks ordered by compute ({' + '.join(COMPUTE_PHASES)}) "
                 "per step over the median of their peers (the ranks of their pipeline stage without its slowest, "
                 "as the Straggler alert compares them), across the whole window. A rank that waits for a "
                 "straggler shows it as comm wait, not compute.</p><table><tr>"
                 "<th>#</th><th>rank</th><th>node</th>" + ("<th>stage</th>" if staged else "") +
                 "<th>compute / step</th><th>over peers</th><th>comm wait / step</th><th>data / step</th></tr>")
    for i, r in enumerate(facts["straggler_ranking"][:MAX_RANKED_BARS], 1):
        parts.append(f"<tr><td class='num'>{i}</td><td class='num'>{r['rank']}</td><td>{e(r['node'])}</td>"
                     + (f"<td class='num'>{e(r['stage'])}</td>" if staged else "") +
                     f"<td class='num'>{_fmt_s(r['compute_per_step_s'])}</td>"
                     f"<td class='num'>{_percent(r['excess_over_peers'])}</td>"
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
                         f"<td>{e(utc(a['from']))}</td><td>{e(utc(a['to']))}</td></tr>")
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
                         f"<td>{e(utc(c['captured_at']))}</td><td>{e(said)}</td>"
                         f"<td><a href='{e(c['url'])}'>{e(c['url'])}</a></td></tr>")
        parts.append("</table>")
    else:
        parts.append("<p>No evidence was captured in this window: no rank stalled or raised.</p>")
    blob = json.dumps(facts, default=str).replace("</", "<\\/")
    parts.append(f"<script type='application/json' id='rankscope-report'>{blob}</script></body></html>")
    return "\n".join(parts)
