"""Measure the VictoriaMetrics path over the scale simulator (deploy/scale/).

    .venv/bin/python -m tests.scale.measure_vm --nodes 1024 --out docs/scaling/victoriametrics-1024.json

Like measure.py, with Debian's victoria-metrics 1.79 in place of Prometheus:
two vmagent members (-promscrape.cluster.*) scraping every 15 s and
remote-writing to one VictoriaMetrics, vmalert evaluating the shipped rules
every 15 s (production thresholds, RankscopeStraggler's for: cut as in
measure.py; rendered by deploy/scale/vmalert_rules.py), the shipped
Alertmanager config. Reports active series, ingestion rate, each process's
RSS, vmalert's per-group evaluation time, the dashboard queries over 1 h and
which rank each fault paged with.
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
import urllib.request
from pathlib import Path

import yaml

from tests.helpers.paging import alertmanager_config
from tests.helpers.promstack import AlertmanagerServer, WebhookReceiver
from tests.scale.measure import FAULT_ALERTS, INTERVAL_S, dashboard_latencies, pages
from tests.scale.vmstack import VictoriaMetricsServer, VMAgent, VMAlert

ROOT = Path(__file__).resolve().parents[2]


def own_metrics(url: str) -> dict[str, list[tuple[dict, float]]]:
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url + "/metrics", timeout=60) as resp:
        text = resp.read().decode()
    out: dict[str, list[tuple[dict, float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def total(m: dict, name: str, **labels: str) -> float:
    return sum(v for lab, v in m.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--members", type=int, default=2, help="vmagent members")
    ap.add_argument("--fault-after", type=float, default=180.0)
    ap.add_argument("--straggler-for", default="1m")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix="rankscope-scale-vm-"))
    override = work / "override.yaml"
    override.write_text(yaml.safe_dump({"for": {"RankscopeStraggler": args.straggler_for}}))
    rules = work / "rules"
    subprocess.run([sys.executable, str(ROOT / "deploy" / "scale" / "vmalert_rules.py"), "--override", str(override),
                    "--out", str(rules)], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    targets_file, manifest_file = work / "targets.json", work / "manifest.json"
    report: dict = {"engine": "victoria-metrics 1.79 (vmagent x%d, vmalert)" % args.members, "nodes": args.nodes,
                    "ranks": args.nodes * 8, "interval_s": INTERVAL_S, "straggler_for": args.straggler_for,
                    "command": "python -m tests.scale.measure_vm " + " ".join(sys.argv[1:] if argv is None else argv)}
    with contextlib.ExitStack() as stack:
        sim = subprocess.Popen([sys.executable, "-m", "tests.scale.simulator", "--nodes", str(args.nodes),
                                "--processes", str(args.processes), "--fault-after", str(args.fault_after),
                                "--targets", str(targets_file), "--manifest", str(manifest_file)],
                               cwd=ROOT, stdout=subprocess.PIPE, text=True)
        stack.callback(lambda: (sim.terminate(), sim.wait(10)))
        faults = json.loads(sim.stdout.readline())["faults"]
        hook = stack.enter_context(WebhookReceiver())
        am = stack.enter_context(AlertmanagerServer(config_text=alertmanager_config(hook)))
        vm = stack.enter_context(VictoriaMetricsServer())
        scrape = {"global": {"scrape_interval": f"{INTERVAL_S}s", "scrape_timeout": "10s"},
                  "scrape_configs": [{"job_name": "rankscope", "file_sd_configs": [{"files": [str(targets_file)]}]}]}
        agents = [stack.enter_context(VMAgent(scrape, remote_write=vm.write_url, members=args.members, member=k))
                  for k in range(args.members)]
        alert = stack.enter_context(VMAlert(sorted(rules.glob("*.yml")), datasource=vm.url, notifier=am.url,
                                            evaluation_interval=f"{INTERVAL_S}s"))
        print(f"simulator {sim.pid}, victoria-metrics {vm.proc.pid} at {vm.url}, vmalert {alert.proc.pid}", flush=True)
        want = {kind: (f["run"], str(f["rank"])) for kind, f in faults.items()}
        deadline = time.monotonic() + args.timeout
        group_samples: list[dict] = []
        rss_peak: dict[str, float] = {}
        while time.monotonic() < deadline:
            time.sleep(INTERVAL_S)
            for name, server in [("victoria-metrics", vm), ("vmalert", alert)] + [
                    (f"vmagent-{k}", a) for k, a in enumerate(agents)]:
                with contextlib.suppress(Exception):
                    rss_peak[name] = max(rss_peak.get(name, 0.0),
                                         total(own_metrics(server.url), "process_resident_memory_bytes"))
            with contextlib.suppress(Exception):
                am_ = own_metrics(alert.url)
                # vmalert's summary of each group's evaluation time (its last ~minutes), quantile 0.5 and 1.
                group_samples.append({"load": os.getloadavg()[0], **{
                    f"{lab['group']}@{lab['quantile']}": v
                    for lab, v in am_.get("vmalert_iteration_duration_seconds", []) if "quantile" in lab}})
            got = pages(hook)
            named = {k: {(r, x) for _, r, x in got.get(FAULT_ALERTS[k], set())} for k in want}
            print(f"{time.strftime('%H:%M:%S')} load={os.getloadavg()[0]:.1f} rss={ {k: round(v / 2**30, 2) for k, v in rss_peak.items()} } "
                  f"groups={group_samples[-1] if group_samples else None} pages={ {k: sorted(v) for k, v in named.items()} }",
                  flush=True)
            if all(want[k] in named[k] for k in want):
                break
        time.sleep(2 * INTERVAL_S)
        vm_m = own_metrics(vm.url)
        rows0, t0 = total(vm_m, "vm_rows_inserted_total"), time.time()
        time.sleep(2 * INTERVAL_S)
        vm_m = own_metrics(vm.url)
        report["samples_per_second"] = (total(vm_m, "vm_rows_inserted_total") - rows0) / (time.time() - t0)
        # Not count({job="rankscope"}): a query touching more than -search.maxUniqueTimeseries
        # (300,000 by default) series is refused with 422; VictoriaMetrics counts its own.
        report["active_series_job"] = total(vm_m, "vm_cache_entries", type="storage/hour_metric_ids")
        report["rss_peak_bytes"] = rss_peak
        report["rule_group_samples"] = group_samples
        last = group_samples[-1] if group_samples else {}
        report["rule_groups"] = {k: v for k, v in last.items() if k != "load"}
        report["load_during"] = os.getloadavg()
        got = pages(hook)
        report["faults"] = {}
        for kind, (run, rank) in want.items():
            named = sorted({(r, k) for _, r, k in got.get(FAULT_ALERTS[kind], set())})
            report["faults"][kind] = {"alert": FAULT_ALERTS[kind], "want": [run, rank], "paged": named,
                                      "ok": named == [(run, rank)]}
        report["other_pages"] = sorted(f"{a} {r}/{k} via {p}" for a, v in got.items()
                                       if a not in FAULT_ALERTS.values() for p, r, k in v)
        report["agents_targets"] = [len(a.active_targets()) for a in agents]
        lat = dashboard_latencies(vm, faults["straggler"]["run"], time.time())
        report["dashboard_queries"] = lat
        secs = [q["seconds"] for q in lat if q["query"] != "(variables)"]
        report["dashboard_summary"] = {"queries": len(secs), "median_s": statistics.median(secs),
                                       "p90_s": sorted(secs)[int(0.9 * (len(secs) - 1))], "max_s": max(secs),
                                       "slowest": sorted(lat, key=lambda q: -q["seconds"])[:5],
                                       "errors": [q for q in lat if q["error"]],
                                       "empty": [f"{q['dashboard']}/{q['query']}" for q in lat if q["series"] == 0]}
    report["load_after"] = os.getloadavg()
    text = json.dumps(report, indent=1, default=list)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(json.dumps({k: v for k, v in report.items() if k not in ("dashboard_queries", "rule_group_samples")},
                     indent=1, default=list))
    return 0 if all(f["ok"] for f in report["faults"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
