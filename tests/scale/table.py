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
        names = sorted({k.rsplit("@", 1)[0] for k in g if "@" in k}, key=lambda n: -g.get(n + "@0.5", 0.0))
        groups = ", ".join(f"{short(name)} {g[name + '@0.5']:.1f} s ({g.get(name + '@1', float('nan')):.1f} s)"
                           for name in names if name + "@0.5" in g)
        d = r["dashboard_summary"]
        faults = ", ".join(f"{k} {'ok' if f['ok'] else 'WRONG'} ({'/'.join(map(str, f['want']))})"
                           for k, f in r["faults"].items())
        print(f"| {r['file']} | {r['nodes']} x 8 = {r['ranks']} | {r['active_series_job'] or 0:,.0f} "
              f"| {r['samples_per_second']:,.0f} | {rss.get('victoria-metrics', 0) / 2**30:.2f} / {agents} / "
              f"{rss.get('vmalert', 0) / 2**30:.2f} GiB | {groups} "
              f"| {d['median_s']:.2f} / {d['p90_s']:.2f} / {d['max_s']:.2f} s ({d['queries']}, {len(d['errors'])} errors) "
              f"| {faults} | {r['load_during'][0]:.1f} |")


def short(group: str) -> str:
    return group.removeprefix("rankscope.")


def group_stats(r: dict, key: str = "rule_group_stats") -> list[dict]:
    """Each rule group's evaluations: median and max seconds, against its own interval.

    From the unique evaluations where the run recorded them, else from the readings of
    prometheus_rule_group_last_duration_seconds every 15 s, else the last reading."""
    intervals = r.get("rule_group_intervals", {})
    out = []
    for name, last in sorted(r["rule_groups"].items()):
        iv = intervals.get(name, r["interval_s"])
        st = r.get(key, {}).get(name)
        if st is None and key != "rule_group_stats":
            continue
        st = st or {"median_s": last, "max_s": last, "samples": 1}
        out.append({"group": name, "interval": iv, "n": st["samples"], "median_s": st["median_s"],
                    "max_s": st["max_s"], "median_pct": 100 * st["median_s"] / iv, "max_pct": 100 * st["max_s"] / iv})
    return out


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
    print("| file | nodes x 8 | head series | samples/s | RSS (peak) | rule groups: slowest median / slowest max "
          "(% of its interval) | max scrape | dashboard queries: median / p90 / max | faults paged (rank) "
          "| load (1 min) | Prometheus CPU (cores) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        d = r.get("dashboard_summary")
        faults = ", ".join(f"{k} {'ok' if f['ok'] else 'WRONG'} ({'/'.join(map(str, f['want']))}"
                           f"{'' if f['ok'] else ' got ' + str(f['paged'])})" for k, f in r["faults"].items())
        stats = group_stats(r)
        worst_med = max(stats, key=lambda g: g["median_pct"])
        worst_max = max(stats, key=lambda g: g["max_pct"])
        groups = (f"{len(stats)} groups: {worst_med['median_pct']:.0f}% ({short(worst_med['group'])}) / "
                  f"{worst_max['max_pct']:.0f}% ({short(worst_max['group'])})")
        queries = (f"{d['median_s']:.2f} / {d['p90_s']:.2f} / {d['max_s']:.2f} s ({d['queries']}, "
                   f"{len(d['errors'])} errors)" if d else "not run")
        cpu = r.get("prometheus_cpu")
        cpu_text = (f"{r['prometheus_cpu_cores_median']:.2f}" if "prometheus_cpu_cores_median" in r else "-")
        if cpu:
            cpu_text += (f"; {cpu['with_rules']['cores']:.2f} with rules, {cpu['without_rules']['cores']:.2f} "
                         f"without ({cpu['with_rules']['seconds']:.0f} s each)")
        print(f"| {r['file']} | {r['nodes']} x 8 = {r['ranks']} | {r['head_series']:,.0f} | {r['samples_per_second']:,.0f} "
              f"| {r['rss_bytes'] / 2**30:.2f} GiB ({r['peak_rss_bytes'] / 2**30:.2f}) | {groups} "
              f"| {r['max_scrape_seconds']:.2f} s | {queries} | {faults} | {r['load_during'][0]:.1f} | {cpu_text} |")
    for r in rows:
        print()
        print(f"{r['file']}: every rule group, seconds per evaluation (% of its interval)")
        print()
        after = {g["group"]: g for g in group_stats(r, "rule_group_stats_after_pages")}
        print("| group | interval | evaluations | median | max | after the pages: evaluations, median, max "
              "| missed iterations |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for g in group_stats(r):
            a = after.get(g["group"])
            tail = (f"{a['n']}, {a['median_s']:.2f} s ({a['median_pct']:.0f}%), {a['max_s']:.2f} s ({a['max_pct']:.0f}%)"
                    if a and "rule_group_stats_after_pages" in r else "-")
            print(f"| {g['group']} | {g['interval']:.0f} s | {g['n']} | {g['median_s']:.2f} s ({g['median_pct']:.0f}%) "
                  f"| {g['max_s']:.2f} s ({g['max_pct']:.0f}%) | {tail} "
                  f"| {r.get('missed_iterations', {}).get(g['group'], 0):.0f} |")
    print()
    for r in rows:
        print(f"{r['file']}, slowest rules: " + ", ".join(
            f"{x['rule']} {x['seconds']:.2f} s" for x in r.get("slowest_rules", [])[:6]))
        print(f"{r['file']}, slowest dashboard queries: " + ", ".join(
            f"{x['dashboard']}/{x['query']} {x['seconds']:.2f} s"
            for x in (r.get("dashboard_summary") or {"slowest": []})["slowest"][:3]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
