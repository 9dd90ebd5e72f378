"""Print docs/scaling.md's tables from the measurements' JSON (tests/scale/measure.py --out).

    python -m tests.scale.table docs/scaling/prometheus-*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def vm_table(rows: list[dict]) -> None:
    """The VictoriaMetrics path's rows (tests/scale/measure_vm.py)."""
    print("| file | nodes x 8 | active series | samples/s | RSS peak: VM / vmagents / vmalert "
          "| vmalert groups, median of last evaluations (max) | dashboard queries: median / p90 / max "
          "| faults paged (rank) | load (1 min) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        rss = r["rss_peak_bytes"]
        agents = " + ".join(f"{v / 2**30:.2f}" for k, v in sorted(rss.items()) if k.startswith("vmagent"))
        g = r["rule_groups"]
        groups = ", ".join(f"{name.split('.')[-1]} {g[name + '@0.5']:.1f} s ({g[name + '@1']:.1f} s)"
                           for name in ("rankscope.recording", "rankscope.alerts") if name + "@0.5" in g)
        d = r["dashboard_summary"]
        faults = ", ".join(f"{k} {'ok' if f['ok'] else 'WRONG'} ({'/'.join(map(str, f['want']))})"
                           for k, f in r["faults"].items())
        print(f"| {r['file']} | {r['nodes']} x 8 = {r['ranks']} | {r['active_series_job'] or 0:,.0f} "
              f"| {r['samples_per_second']:,.0f} | {rss.get('victoria-metrics', 0) / 2**30:.2f} / {agents} / "
              f"{rss.get('vmalert', 0) / 2**30:.2f} GiB | {groups} "
              f"| {d['median_s']:.2f} / {d['p90_s']:.2f} / {d['max_s']:.2f} s ({d['queries']}, {len(d['errors'])} errors) "
              f"| {faults} | {r['load_during'][0]:.1f} |")


def main(paths: list[str]) -> int:
    rows = sorted(({**json.loads(Path(p).read_text()), "file": Path(p).name} for p in paths),
                  key=lambda r: (r["nodes"], r["file"]))
    vm_rows = [r for r in rows if r.get("engine", "").startswith("victoria")]
    if vm_rows:
        vm_table(vm_rows)
        print()
    rows = [r for r in rows if r not in vm_rows]
    if not rows:
        return 0
    print("| file | nodes x 8 | head series | samples/s | RSS (peak) | recording group | alerts group "
          "| max scrape | dashboard queries: median / p90 / max | faults paged (rank) | load (1 min) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        g = r["rule_groups"]
        iv = r["interval_s"]
        d = r["dashboard_summary"]
        faults = ", ".join(f"{k} {'ok' if f['ok'] else 'WRONG'} ({'/'.join(map(str, f['want']))}"
                           f"{'' if f['ok'] else ' got ' + str(f['paged'])})" for k, f in r["faults"].items())
        stats = r.get("rule_group_stats", {})

        def group(name: str) -> str:
            if name not in g:
                return "-"
            last = f"{g[name]:.2f} s ({100 * g[name] / iv:.0f}%)"
            if name in stats:  # median and max of the readings every 15 s while the faults paged
                st = stats[name]
                return (f"{last}; median {st['median_s']:.2f} s ({100 * st['median_s'] / iv:.0f}%), "
                        f"max {st['max_s']:.2f} s ({100 * st['max_s'] / iv:.0f}%)")
            return last
        print(f"| {r['file']} | {r['nodes']} x 8 = {r['ranks']} | {r['head_series']:,.0f} | {r['samples_per_second']:,.0f} "
              f"| {r['rss_bytes'] / 2**30:.2f} GiB ({r['peak_rss_bytes'] / 2**30:.2f}) "
              f"| {group('rankscope.recording')} | {group('rankscope.alerts')} "
              f"| {r['max_scrape_seconds']:.2f} s | {d['median_s']:.2f} / {d['p90_s']:.2f} / {d['max_s']:.2f} s "
              f"({d['queries']}, {len(d['errors'])} errors) | {faults} | {r['load_during'][0]:.1f} |")
    print()
    for r in rows:
        print(f"{r['file']}, slowest rules: " + ", ".join(
            f"{x['rule']} {x['seconds']:.2f} s" for x in r.get("slowest_rules", [])[:6]))
        print(f"{r['file']}, slowest dashboard queries: " + ", ".join(
            f"{x['dashboard']}/{x['query']} {x['seconds']:.2f} s" for x in r["dashboard_summary"]["slowest"][:3]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
