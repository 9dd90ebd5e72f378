"""What each rule costs at scale: rule sets A/B-compared in one Prometheus over the simulator.

    .venv/bin/python -m tests.scale.rule_costs --nodes 256 \\
        --variant before=git:HEAD~1 --variant after=prometheus/rules --cycles 2 --rounds 5 \\
        --out docs/scaling/rule-costs-256.json

Starts the simulator (N nodes x 8 ranks) and Debian's Prometheus 2.42 scraping
it every 15 s, evaluating every 15 s. Each variant is a set of rule files (a
directory, or ``git:REV`` for ``prometheus/rules/*.yml`` at a commit); the
variants are loaded in turn (A, B, A, B, ...: ``--cycles``), by replacing the
files Prometheus's ``rule_files`` glob reads and reloading, so they evaluate
over the same TSDB, the same series and similar load. While a variant is
loaded, every group evaluation is read back from /api/v1/rules (the group's
``evaluationTime`` and each rule's).
Also reported per phase: the load average and Prometheus's CPU use
(``process_cpu_seconds_total`` per wall second).

The TSDB holds minutes of samples: the 1 h windows read minutes, not an hour.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.helpers.promstack import PrometheusServer
from tests.scale.measure import INTERVAL_S, api, one, prom_metrics

ROOT = Path(__file__).resolve().parents[2]


def variant_files(spec: str, into: Path) -> list[Path]:
    """Copy a variant's rule files into ``into`` (a fresh directory); return them."""
    into.mkdir(parents=True, exist_ok=True)
    if spec.startswith("git:"):
        rev = spec[4:]
        names = subprocess.run(["git", "ls-tree", "--name-only", rev, "prometheus/rules/"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.split()
        for name in names:
            if name.endswith(".yml"):
                text = subprocess.run(["git", "show", f"{rev}:{name}"], cwd=ROOT, capture_output=True,
                                      text=True, check=True).stdout
                (into / Path(name).name).write_text(text)
    else:
        for path in sorted(Path(spec).glob("*.yml")):
            shutil.copy(path, into / path.name)
    return sorted(into.glob("*.yml"))


def load(prom: PrometheusServer, active: Path, files: list[Path]) -> set[str]:
    """Make ``files`` the only rule files Prometheus reads; reload; return the group names."""
    import yaml
    for old in active.glob("*.yml"):
        old.unlink()
    names = set()
    for f in files:
        shutil.copy(f, active / f.name)
        names |= {g["name"] for g in yaml.safe_load(f.read_text())["groups"]}
    prom.reload()
    deadline = time.monotonic() + 60
    while {g["name"] for g in api(prom, "rules")["groups"]} != names:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rules not reloaded: want groups {names}")
        time.sleep(1)
    return names


def rule_key(rule: dict) -> str:
    """A rule's name; the cause records share one, told apart by their cause label."""
    cause = (rule.get("labels") or {}).get("cause")
    return f"{rule.get('name')}{{cause={cause}}}" if cause else rule.get("name")


def observe(prom: PrometheusServer, seconds: float) -> dict:
    """Every group evaluation that ended in the next ``seconds`` (polled every 3 s)."""
    seen: dict[tuple[str, str], dict] = {}
    before = {(g["name"], g.get("lastEvaluation", "")) for g in api(prom, "rules")["groups"]}
    m0, t0 = prom_metrics(prom), time.monotonic()
    loads = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for g in api(prom, "rules")["groups"]:
            at = g.get("lastEvaluation", "")
            if at.startswith("0001"):
                continue
            if (g["name"], at) in before or (g["name"], at) in seen:
                continue
            seen[(g["name"], at)] = {"group": g["name"], "interval": g.get("interval"), "at": at,
                                     "seconds": g.get("evaluationTime", 0.0),
                                     "rules": {rule_key(r): r.get("evaluationTime", 0.0) for r in g["rules"]}}
        loads.append(os.getloadavg()[0])
        time.sleep(3)
    m1, t1 = prom_metrics(prom), time.monotonic()
    cpu = (one(m1, "process_cpu_seconds_total") - one(m0, "process_cpu_seconds_total")) / (t1 - t0)
    return {"evaluations": list(seen.values()), "load_median": statistics.median(loads), "load_max": max(loads),
            "prometheus_cpu_cores": cpu,
            "head_series": one(m1, "prometheus_tsdb_head_series")}


def query_stats(prom: PrometheusServer, files: list[Path]) -> dict[str, dict]:
    """Each rule's expression run once as an instant query with ``stats=all``: the samples it
    reads (totalQueryableSamples, a cost that does not depend on the machine's load) and the
    peak number of samples held at once."""
    import yaml
    out = {}
    t = time.time()
    for f in files:
        for g in yaml.safe_load(f.read_text())["groups"]:
            for rule in g["rules"]:
                key = rule_key({"name": rule.get("record") or rule.get("alert"), "labels": rule.get("labels")})
                data = api(prom, "query", query=rule["expr"], time=str(t), stats="all")
                st = data.get("stats", {})
                out[key] = {"group": g["name"], "samples": st.get("samples", {}).get("totalQueryableSamples"),
                            "peak_samples": st.get("samples", {}).get("peakSamples"),
                            "eval_s": st.get("timings", {}).get("evalTotalTime")}
    return out


def summarise(phases: list[dict]) -> dict:
    """Per variant: each group's median/max evaluation time (and % of its interval), each rule's median."""
    out: dict[str, dict] = {}
    for ph in phases:
        v = out.setdefault(ph["variant"], {"groups": {}, "rules": {}, "loads": [], "cpu": []})
        v["loads"].append(ph["load_median"])
        v["cpu"].append(ph["prometheus_cpu_cores"])
        for e in ph["evaluations"]:
            v["groups"].setdefault(e["group"], {"interval": e["interval"], "seconds": []})["seconds"].append(e["seconds"])
            for rule, s in e["rules"].items():
                v["rules"].setdefault(rule, {"group": e["group"], "seconds": []})["seconds"].append(s)
    for v in out.values():
        for g in v["groups"].values():
            s = g.pop("seconds")
            g.update(n=len(s), median_s=statistics.median(s), max_s=max(s),
                     median_pct=100 * statistics.median(s) / g["interval"], max_pct=100 * max(s) / g["interval"])
        for r in v["rules"].values():
            s = r.pop("seconds")
            r.update(n=len(s), median_s=statistics.median(s), max_s=max(s))
        v["rules_total_median_s"] = sum(r["median_s"] for r in v["rules"].values())
        v["load_median"] = statistics.median(v.pop("loads"))
        v["prometheus_cpu_cores"] = statistics.median(v.pop("cpu"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--processes", type=int, default=2, help="simulator server processes")
    ap.add_argument("--variant", action="append", required=True, metavar="NAME=DIR|git:REV")
    ap.add_argument("--cycles", type=int, default=2, help="times each variant is loaded, alternating")
    ap.add_argument("--rounds", type=int, default=5, help="15 s evaluations observed per phase")
    ap.add_argument("--warmup", type=float, default=150.0, help="seconds of scraping before the first phase")
    ap.add_argument("--fault-after", type=float, default=60.0, help="the NaN and the hang start this late")
    ap.add_argument("--query-stats", action="store_true",
                    help="at the end, run every variant's rule expressions once with stats=all (samples read)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix="rankscope-rulecost-"))
    variants = {}
    for spec in args.variant:
        name, _, where = spec.partition("=")
        variants[name] = variant_files(where, work / "variants" / name)
    active = work / "active"
    active.mkdir()
    targets_file = work / "targets.json"
    report: dict = {"nodes": args.nodes, "ranks": args.nodes * 8, "interval_s": INTERVAL_S,
                    "variants": dict(v.partition("=")[::2] for v in args.variant),
                    "command": " ".join(["python -m tests.scale.rule_costs", *(sys.argv[1:] if argv is None else argv)]),
                    "phases": []}
    with contextlib.ExitStack() as stack:
        sim = subprocess.Popen([sys.executable, "-m", "tests.scale.simulator", "--nodes", str(args.nodes),
                                "--processes", str(args.processes), "--fault-after", str(args.fault_after),
                                "--targets", str(targets_file)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        stack.callback(lambda: (sim.terminate(), sim.wait(10)))
        manifest = json.loads(sim.stdout.readline())
        print(f"simulator pid {sim.pid}: faults {manifest['faults']}", flush=True)
        config = PrometheusServer.build_config(rule_files=[], scrape_interval=f"{INTERVAL_S}s",
                                               evaluation_interval=f"{INTERVAL_S}s")
        config["global"]["scrape_timeout"] = "10s"
        config["rule_files"] = [str(active / "*.yml")]
        config["scrape_configs"] = [{"job_name": "rankscope", "file_sd_configs": [{"files": [str(targets_file)]}]}]
        prom = stack.enter_context(PrometheusServer(config=config))
        print(f"prometheus pid {prom.proc.pid} at {prom.url}; warming up {args.warmup:.0f} s", flush=True)
        # The first variant evaluates during the warm-up too, so its records exist when phases start.
        first = next(iter(variants))
        load(prom, active, variants[first])
        time.sleep(args.warmup)
        for cycle in range(args.cycles):
            for name, files in variants.items():
                load(prom, active, files)
                t = time.strftime("%H:%M:%S")
                ph = observe(prom, (args.rounds + 1) * INTERVAL_S + 5)
                ph.update(variant=name, cycle=cycle, started=t)
                report["phases"].append(ph)
                groups = {}
                for e in ph["evaluations"]:
                    groups.setdefault(e["group"], []).append(e["seconds"])
                print(f"{t} {name} cycle {cycle}: load {ph['load_median']:.1f}, prometheus "
                      f"{ph['prometheus_cpu_cores']:.2f} cores, groups "
                      + ", ".join(f"{g} {statistics.median(s):.2f}s/{len(s)}" for g, s in sorted(groups.items())),
                      flush=True)
        if args.query_stats:
            report["query_stats"] = {name: query_stats(prom, files) for name, files in variants.items()}
    report["summary"] = summarise(report["phases"])
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    for name, v in report["summary"].items():
        print(f"== {name}: load {v['load_median']:.1f}, prometheus {v['prometheus_cpu_cores']:.2f} cores, "
              f"sum of rule medians {v['rules_total_median_s']:.2f} s")
        for g, s in sorted(v["groups"].items()):
            print(f"  group {g} (every {s['interval']:.0f} s): median {s['median_s']:.2f} s ({s['median_pct']:.0f}%),"
                  f" max {s['max_s']:.2f} s ({s['max_pct']:.0f}%), n={s['n']}")
        for r, s in sorted(v["rules"].items(), key=lambda kv: -kv[1]["median_s"])[:15]:
            print(f"  {s['median_s']:.3f} s  {r} ({s['group']})")
    for name, stats in report.get("query_stats", {}).items():
        print(f"== {name}: samples read per evaluation of every rule, {sum(x['samples'] or 0 for x in stats.values()):,}")
        for r, x in sorted(stats.items(), key=lambda kv: -(kv[1]["samples"] or 0))[:15]:
            print(f"  {x['samples']:>10,}  {r} ({x['group']})")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
