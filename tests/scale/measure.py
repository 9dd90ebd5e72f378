"""Measure one Prometheus 2.42 over the scale simulator, with the shipped rules.

    .venv/bin/python -m tests.scale.measure --nodes 256 --out docs/scaling/256.json

Starts the simulator (N nodes x 8 ranks, see simulator.py), Debian's real
Prometheus (scrape and evaluation every 15 s, production thresholds, every
``for:`` production except RankscopeStraggler's 10m, cut by ``--straggler-for``
so a measurement fits in minutes), the shipped Alertmanager config pointed at a
webhook recorder, and then reports:

- head series, samples appended per second, Prometheus RSS (from its /metrics);
- ``prometheus_rule_group_last_duration_seconds`` per group, against the interval;
- the wall time of every dashboard query over a 1 h range at a 15 s step, the
  variables resolved as Grafana would (run = the straggler's run, every other
  variable "All");
- which rank each of the three injected faults paged with (NaN, straggler, hang).

Note: the TSDB holds only the minutes the measurement ran, so a 1 h range
query reads those minutes, not a full hour of samples.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from prometheus import generate
from tests.helpers.paging import alertmanager_config
from tests.helpers.promstack import (AlertmanagerServer, PrometheusServer, WebhookReceiver, firing_alerts,
                                     http_get_json)
from tests.integration.test_dashboard_queries import all_targets, interpolate, DASHBOARDS

ROOT = Path(__file__).resolve().parents[2]
INTERVAL_S = 15
FAULT_ALERTS = {"nan": "RankscopeNonFiniteLoss", "straggler": "RankscopeStraggler", "hang": "RankscopeHangSuspect"}
BUILTINS = {"__rate_interval": f"{4 * INTERVAL_S}s", "__interval": f"{INTERVAL_S}s",
            "__interval_ms": str(INTERVAL_S * 1000), "__range": "1h"}


def prom_metrics(prom: PrometheusServer) -> dict[str, list[tuple[dict, float]]]:
    """Prometheus's own /metrics, parsed."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(prom.url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, list[tuple[dict, float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def one(metrics: dict, name: str) -> float:
    return metrics[name][0][1]


QUERY_TIMEOUT_S = 120  # Prometheus's own default query timeout is 2 min; promstack's client waits only 5 s


def api(prom: PrometheusServer, path: str, **params: str):
    """GET /api/v1/<path> with a client timeout long enough for a slow query."""
    body = http_get_json(f"{prom.url}/api/v1/{path}?{urllib.parse.urlencode(params)}", timeout=QUERY_TIMEOUT_S)
    if body.get("status") != "success":
        raise RuntimeError(f"API error for {path}: {body}")
    return body["data"]


def label_values(prom: PrometheusServer, query: str, values: dict[str, str], start: float, end: float) -> list[str]:
    import re
    m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", query.strip())
    selector, label = interpolate(m.group(1), values), m.group(2)
    return api(prom, f"label/{label}/values", **{"match[]": selector, "start": str(start), "end": str(end)})


def dashboard_latencies(prom: PrometheusServer, run: str, end: float) -> list[dict]:
    """Every panel query over [end - 1h, end], timed; variables as Grafana resolves them (others "All")."""
    start = end - 3600
    results = []
    resolved: dict[str, dict[str, str]] = {}
    for uid, d in DASHBOARDS.items():
        values = dict(BUILTINS)
        t0 = time.perf_counter()
        for v in d["templating"]["list"]:
            if v["type"] == "datasource":
                values[v["name"]] = v["current"]["value"]
            elif v["type"] == "query":
                found = label_values(prom, v["query"]["query"], values, start, end)
                values[v["name"]] = run if v["name"] == "run" else v.get("allValue") or ".*"
        resolved[uid] = values
        results.append({"dashboard": uid, "query": "(variables)", "seconds": time.perf_counter() - t0,
                        "series": None, "error": None})
    for t in all_targets():
        expr = interpolate(t.expr, resolved[t.uid])
        t0 = time.perf_counter()
        error, n = None, 0
        try:
            if t.instant:
                data = api(prom, "query", query=expr, time=str(end))
            else:
                data = api(prom, "query_range", query=expr, start=str(start), end=str(end), step=str(INTERVAL_S))
            n = len(data["result"])
        except Exception as e:  # noqa: BLE001 - recorded, reported
            error = repr(e)[:300]
        results.append({"dashboard": t.uid, "query": f"{t.panel}/{t.ref}", "seconds": time.perf_counter() - t0,
                        "series": n, "error": error})
    return results


def record_evaluations(prom: PrometheusServer, into: dict) -> None:
    """Each group's last evaluation (its duration and its slowest rules), keyed by when it ran."""
    for g in api(prom, "rules")["groups"]:
        at = g.get("lastEvaluation", "")
        if at.startswith("0001") or (g["name"], at) in into:
            continue
        rules = sorted(g["rules"], key=lambda r: -r.get("evaluationTime", 0.0))[:3]
        into[(g["name"], at)] = {"group": g["name"], "at": at, "seconds": g.get("evaluationTime", 0.0),
                                 "load": os.getloadavg()[0], "read_at": time.time(),
                                 "slowest": [[r.get("name"), r.get("evaluationTime", 0.0)] for r in rules]}


def cpu_window(prom: PrometheusServer, seconds: float) -> dict:
    """Prometheus's CPU seconds per wall second over the next ``seconds``, and the load average."""
    m0, t0 = prom_metrics(prom), time.monotonic()
    time.sleep(seconds)
    m1, t1 = prom_metrics(prom), time.monotonic()
    return {"cores": (one(m1, "process_cpu_seconds_total") - one(m0, "process_cpu_seconds_total")) / (t1 - t0),
            "seconds": t1 - t0, "load": os.getloadavg()[0]}


def pages(hook: WebhookReceiver) -> dict[str, set[tuple[str, str, str]]]:
    """alertname -> {(receiver path, run, rank)} delivered firing."""
    out: dict[str, set] = {}
    for d in hook.snapshot():
        for a in firing_alerts(d):
            lab = a["labels"]
            out.setdefault(lab["alertname"], set()).add((d.path, lab.get("run", ""), lab.get("rank", "")))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--processes", type=int, default=2, help="simulator server processes")
    ap.add_argument("--fault-after", type=float, default=180.0, help="seconds before the NaN and the hang start")
    ap.add_argument("--straggler-for", default="1m", help="RankscopeStraggler's for: (production: 10m)")
    ap.add_argument("--timeout", type=float, default=600.0, help="give up waiting for the pages after this")
    ap.add_argument("--extra-rounds", type=int, default=2,
                    help="15 s rounds of rule evaluations read after the pages, before the final readings")
    ap.add_argument("--ingest-only-window", type=float, default=0.0,
                    help="seconds: Prometheus's CPU use with the rules, then as long without them (0: skip)")
    ap.add_argument("--no-dashboards", dest="dashboards", action="store_false",
                    help="skip the dashboard query timings")
    ap.add_argument("--out", type=Path, help="write the measurement (JSON) here")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop every server started here

    work = Path(tempfile.mkdtemp(prefix="rankscope-scale-"))
    override = work / "override.yaml"
    override.write_text(yaml.safe_dump({"for": {"RankscopeStraggler": args.straggler_for}}))
    rules_dir = work / "rules"
    generate.main(["--override", str(override), "--out", str(rules_dir)])
    rules = [rules_dir / generate.RECORDING_FILE, rules_dir / generate.ALERTS_FILE]
    targets_file, manifest_file = work / "targets.json", work / "manifest.json"
    sim_cmd = [sys.executable, "-m", "tests.scale.simulator", "--nodes", str(args.nodes),
               "--processes", str(args.processes),
               "--fault-after", str(args.fault_after), "--targets", str(targets_file),
               "--manifest", str(manifest_file)]
    report: dict = {"nodes": args.nodes, "ranks": args.nodes * 8, "interval_s": INTERVAL_S,
                    "straggler_for": args.straggler_for, "command": " ".join(["python -m tests.scale.measure", *sys.argv[1:]] if argv is None else argv)}
    with contextlib.ExitStack() as stack:
        sim = subprocess.Popen(sim_cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        stack.callback(lambda: (sim.terminate(), sim.wait(10)))
        manifest = json.loads(sim.stdout.readline())
        faults = manifest["faults"]
        print(f"simulator pid {sim.pid}: {args.nodes} nodes on ports {manifest['ports']}; faults {faults}", flush=True)
        hook = stack.enter_context(WebhookReceiver())
        am = stack.enter_context(AlertmanagerServer(config_text=alertmanager_config(hook)))
        config = PrometheusServer.build_config(rule_files=rules, alertmanager=am.address,
                                               scrape_interval=f"{INTERVAL_S}s", evaluation_interval=f"{INTERVAL_S}s")
        config["global"]["scrape_timeout"] = "10s"
        config["rule_files"] = [str(rules_dir / "*.yml")]  # a glob: emptied for the ingest-only window
        config["scrape_configs"] = [{"job_name": "rankscope",
                                     "file_sd_configs": [{"files": [str(targets_file)]}]}]
        prom = stack.enter_context(PrometheusServer(config=config))
        print(f"prometheus pid {prom.proc.pid} at {prom.url}", flush=True)
        deadline = time.monotonic() + args.timeout
        want = {kind: (f["run"], str(f["rank"])) for kind, f in faults.items()}
        peak_rss = 0.0
        group_samples: list[dict] = []
        evaluations: dict[tuple[str, str], dict] = {}
        cpu_samples: list[dict] = []
        cpu_prev = None
        while time.monotonic() < deadline:
            time.sleep(INTERVAL_S)
            m = prom_metrics(prom)
            peak_rss = max(peak_rss, one(m, "process_resident_memory_bytes"))
            now_cpu = (time.monotonic(), one(m, "process_cpu_seconds_total"))
            if cpu_prev:
                cpu_samples.append({"load": os.getloadavg()[0],
                                    "cores": (now_cpu[1] - cpu_prev[1]) / (now_cpu[0] - cpu_prev[0])})
            cpu_prev = now_cpu
            # One reading of a group's last duration is noisy on a shared machine: keep them all.
            group_samples.append({"load": os.getloadavg()[0], **{
                labels["rule_group"].split(";")[-1]: v
                for labels, v in m.get("prometheus_rule_group_last_duration_seconds", [])}})
            record_evaluations(prom, evaluations)
            got = pages(hook)
            named = {kind: {(run, rank) for _, run, rank in got.get(FAULT_ALERTS[kind], set())} for kind in want}
            print(f"{time.strftime('%H:%M:%S')} head={one(m, 'prometheus_tsdb_head_series'):.0f} "
                  f"rss={one(m, 'process_resident_memory_bytes') / 2**30:.2f}GiB load={os.getloadavg()[0]:.1f} "
                  f"pages={ {k: sorted(v) for k, v in named.items()} }", flush=True)
            if all(want[k] in named[k] for k in want):
                report["all_paged_at"] = time.time()
                break
        # Let the rules run a few more rounds at full size before reading their durations.
        for _ in range(args.extra_rounds):
            time.sleep(INTERVAL_S)
            record_evaluations(prom, evaluations)
        m = prom_metrics(prom)
        appended = one(m, "prometheus_tsdb_head_samples_appended_total")
        t1 = time.time()
        time.sleep(2 * INTERVAL_S)
        m2 = prom_metrics(prom)
        report["samples_per_second"] = (one(m2, "prometheus_tsdb_head_samples_appended_total") - appended) / (time.time() - t1)
        report["head_series"] = one(m2, "prometheus_tsdb_head_series")
        report["rss_bytes"] = one(m2, "process_resident_memory_bytes")
        report["peak_rss_bytes"] = max(peak_rss, report["rss_bytes"])
        report["rule_groups"] = {labels["rule_group"].split(";")[-1]: v
                                 for labels, v in m2["prometheus_rule_group_last_duration_seconds"]}
        group_samples.append({"load": os.getloadavg()[0], **report["rule_groups"]})
        report["rule_group_samples"] = group_samples
        record_evaluations(prom, evaluations)
        report["rule_group_intervals"] = {labels["rule_group"].split(";")[-1]: v
                                          for labels, v in m2.get("prometheus_rule_group_interval_seconds", [])}
        # Each evaluation once (a 1 m group's last duration reads the same evaluation 4 times).
        report["rule_group_evaluations"] = sorted(evaluations.values(), key=lambda e: (e["group"], e["at"]))
        report["rule_group_stats"] = {
            g: {"median_s": statistics.median(v), "max_s": max(v), "samples": len(v),
                "interval_s": report["rule_group_intervals"].get(g, INTERVAL_S)}
            for g in report["rule_groups"]
            for v in [[e["seconds"] for e in evaluations.values() if e["group"] == g]
                      or [x[g] for x in group_samples if x.get(g)]] if v}
        after = [e for e in evaluations.values() if e["read_at"] >= report.get("all_paged_at", float("inf"))]
        report["rule_group_stats_after_pages"] = {
            g: {"median_s": statistics.median(v), "max_s": max(v), "samples": len(v),
                "interval_s": report["rule_group_intervals"].get(g, INTERVAL_S)}
            for g in report["rule_groups"] for v in [[e["seconds"] for e in after if e["group"] == g]] if v}
        report["prometheus_cpu_samples"] = cpu_samples
        if cpu_samples:
            report["prometheus_cpu_cores_median"] = statistics.median(c["cores"] for c in cpu_samples)
        report["missed_iterations"] = {labels["rule_group"].split(";")[-1]: v
                                       for labels, v in m2.get("prometheus_rule_group_iterations_missed_total", [])}
        report["slowest_rules"] = sorted(
            ({"group": g["name"], "rule": r.get("name"), "seconds": r.get("evaluationTime", 0.0)}
             for g in api(prom, "rules")["groups"] for r in g["rules"]), key=lambda r: -r["seconds"])[:10]
        scrape = api(prom, "query", query='max(scrape_duration_seconds{job="rankscope"})')["result"]
        report["max_scrape_seconds"] = float(scrape[0]["value"][1]) if scrape else None
        report["targets_up"] = float(api(prom, "query", query='sum(up{job="rankscope"})')["result"][0]["value"][1])
        report["load_during"] = os.getloadavg()
        got = pages(hook)
        report["faults"] = {}
        for kind, (run, rank) in want.items():
            named = sorted({(r, k) for _, r, k in got.get(FAULT_ALERTS[kind], set())})
            report["faults"][kind] = {"alert": FAULT_ALERTS[kind], "want": [run, rank], "paged": named,
                                      "ok": named == [(run, rank)]}
        report["other_pages"] = sorted(f"{a} {r}/{k} via {p}" for a, v in got.items()
                                       if a not in FAULT_ALERTS.values() for p, r, k in v)
        if args.ingest_only_window:
            # Prometheus's CPU with the same scrapes and no rules: what ingestion alone costs.
            ingest = {"with_rules": cpu_window(prom, args.ingest_only_window)}
            for f in rules_dir.glob("*.yml"):
                f.rename(f.with_suffix(".off"))
            prom.reload()
            time.sleep(INTERVAL_S)
            ingest["without_rules"] = cpu_window(prom, args.ingest_only_window)
            for f in rules_dir.glob("*.off"):
                f.rename(f.with_suffix(".yml"))
            prom.reload()
            report["prometheus_cpu"] = ingest
            print(f"prometheus cpu: {ingest}", flush=True)
        if args.dashboards:
            report["load_before_queries"] = os.getloadavg()
            lat = dashboard_latencies(prom, faults["straggler"]["run"], time.time())
            report["dashboard_queries"] = lat
            secs = [q["seconds"] for q in lat if q["query"] != "(variables)"]
            report["dashboard_summary"] = {"queries": len(secs), "median_s": statistics.median(secs),
                                           "p90_s": sorted(secs)[int(0.9 * (len(secs) - 1))], "max_s": max(secs),
                                           "slowest": sorted(lat, key=lambda q: -q["seconds"])[:5],
                                           "errors": [q for q in lat if q["error"]],
                                           "empty": [f"{q['dashboard']}/{q['query']}" for q in lat
                                                     if q["series"] == 0]}
    report["load_after"] = os.getloadavg()
    text = json.dumps(report, indent=1, default=list)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    summary = {k: v for k, v in report.items()
               if k not in ("dashboard_queries", "rule_group_evaluations", "rule_group_samples", "prometheus_cpu_samples")}
    print(json.dumps(summary, indent=1, default=list))
    return 0 if all(f["ok"] for f in report["faults"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
