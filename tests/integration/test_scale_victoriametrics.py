"""The path past one Prometheus, with Debian's real binaries: sharded vmagent ->
VictoriaMetrics -> vmalert -> Alertmanager, over the scale simulator.

Side by side over the same simulated cluster (tests/scale/simulator.py, 4
nodes x 8 ranks, two runs with a straggler, a NaN loss and a hang):

- the VictoriaMetrics stack: two vmagent members, each scraping its share of
  the targets (-promscrape.cluster.*), remote-writing to one VictoriaMetrics;
  vmalert evaluating the shipped recording and alert rules (fast drill
  thresholds, as the Prometheus drills use, rendered for vmalert by
  deploy/scale/vmalert_rules.py) and notifying an Alertmanager with the
  shipped routes;
- the reference: Debian's Prometheus 2.42 with the same rules and its own
  Alertmanager.

Both must page the three faults the same way (same receiver, alert, run and
rank, and nothing else), and every dashboard query must run on
VictoriaMetrics and return data exactly where it does on Prometheus.
"""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prometheus import generate
from tests.helpers.paging import alertmanager_config
from tests.helpers.promstack import AlertmanagerServer, PrometheusServer, WebhookReceiver, firing_alerts, poll
from tests.scale.vmstack import VictoriaMetricsServer, VMAgent, VMAlert
from tests.integration.test_dashboard_queries import DASHBOARDS, all_targets, interpolate

ROOT = Path(__file__).resolve().parents[2]
FAST_OVERRIDE = ROOT / "prometheus" / "fast.yaml"
NODES = 4
MEMBERS = 2
FAULT_AFTER_S = 25  # the straggler is slow from the start; NaN and hang begin here
STEP_S = 1
# The three injected faults: the alert each must raise, and where Alertmanager routes it.
EXPECTED = {"nan": ("RankscopeNonFiniteLoss", "/page"), "straggler": ("RankscopeStraggler", "/chat"),
            "hang": ("RankscopeHangSuspect", "/page")}
PAGE_TIMEOUT_S = 90
# Panels the simulator gives no data for, on either stack (checked: the query runs).
SIMULATOR_HAS_NO = {
    ("rankscope-memory-devices", "OOM events"): "no rank runs out of memory in the simulation",
    ("rankscope-memory-devices", "Ranks that hit OOM"): "no rank runs out of memory in the simulation",
    ("rankscope-run-overview", "Ranks down"): "no rank dies in the simulation",
    ("rankscope-communication", "Collective duration p50 per process group"):
        "the simulator replays a gloo recording, which has no per-process-group durations",
    ("rankscope-memory-devices", "GPU throttling"): "no simulated GPU throttles (the panel shows reasons > 0)",
    ("rankscope-ranks", "Compute time per step per stage"): "the simulated jobs are data-parallel: no pipeline stages",
    ("rankscope-ranks", "Stages against each other"): "the simulated jobs are data-parallel: no pipeline stages",
    ("rankscope-run-overview", "Replicas in agreement"):
        "the simulator's recorded page predates the replica check: no rank publishes a fingerprint",
    ("rankscope-communication", "Bus bandwidth per rank and op"):
        "the simulator's recorded page predates bus bytes (rankscope_collective_bus_bytes_total)",
    ("rankscope-communication", "Bus bandwidth per process group"):
        "the simulator replays a gloo recording, which has no per-process-group durations",
    ("rankscope-communication", "Link throughput against its speed"):
        "the simulator serves no node network series (its recorded page was taken without them)",
    ("rankscope-communication", "Queues held back and credit waits"):
        "the simulator serves no node network series (its recorded page was taken without them)",
}
# Queries (panel, refId) of panels that otherwise have data.
SIMULATOR_HAS_NO_QUERY = {
    ("rankscope-run-overview", "Divergence events", "B"): "no loss spike in the simulation",
    ("rankscope-run-overview", "Divergence events", "C"): "no gradient-norm spike in the simulation",
}


def delivered(hook: WebhookReceiver) -> set[tuple[str, str, str, str]]:
    """(receiver path, alertname, run, rank) of every firing alert delivered."""
    return {(d.path, a["labels"]["alertname"], a["labels"].get("run", ""), a["labels"].get("rank", ""))
            for d in hook.snapshot() for a in firing_alerts(d)}


def fault_pages(manifest: dict) -> set[tuple[str, str, str, str]]:
    return {(path, alert, manifest["faults"][kind]["run"], str(manifest["faults"][kind]["rank"]))
            for kind, (alert, path) in EXPECTED.items()}


@pytest.fixture(scope="module")
def stacks(tmp_path_factory):
    work = tmp_path_factory.mktemp("scale-vm")
    prom_rules = work / "prom-rules"
    generate.main(["--override", str(FAST_OVERRIDE), "--out", str(prom_rules)])
    vm_rules = work / "vm-rules"
    subprocess.run([sys.executable, str(ROOT / "deploy" / "scale" / "vmalert_rules.py"),
                    "--override", str(FAST_OVERRIDE), "--out", str(vm_rules)], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL)
    targets_file, manifest_file = work / "targets.json", work / "manifest.json"
    with contextlib.ExitStack() as stack:
        sim = subprocess.Popen([sys.executable, "-m", "tests.scale.simulator", "--nodes", str(NODES),
                                "--processes", "2", "--fault-after", str(FAULT_AFTER_S),
                                "--targets", str(targets_file), "--manifest", str(manifest_file)],
                               cwd=ROOT, stdout=subprocess.PIPE, text=True)
        stack.callback(lambda: (sim.terminate(), sim.wait(10)))
        manifest = json.loads(sim.stdout.readline())
        scrape = {"global": {"scrape_interval": f"{STEP_S}s", "scrape_timeout": f"{STEP_S}s"},
                  "scrape_configs": [{"job_name": "rankscope", "file_sd_configs": [{"files": [str(targets_file)]}]}]}
        vm_hook = stack.enter_context(WebhookReceiver())
        vm_am = stack.enter_context(AlertmanagerServer(config_text=alertmanager_config(vm_hook)))
        vm = stack.enter_context(VictoriaMetricsServer())
        agents = [stack.enter_context(VMAgent(scrape, remote_write=vm.write_url, members=MEMBERS, member=k))
                  for k in range(MEMBERS)]
        stack.enter_context(VMAlert(sorted(vm_rules.glob("*.yml")), datasource=vm.url, notifier=vm_am.url,
                                    evaluation_interval=f"{STEP_S}s",
                                    extra_args=["-remoteWrite.flushInterval=1s"]))
        prom_hook = stack.enter_context(WebhookReceiver())
        prom_am = stack.enter_context(AlertmanagerServer(config_text=alertmanager_config(prom_hook)))
        prom_config = PrometheusServer.build_config(rule_files=sorted(prom_rules.glob("*.yml")),
                                                    alertmanager=prom_am.address)
        prom_config["scrape_configs"] = scrape["scrape_configs"]
        prom = stack.enter_context(PrometheusServer(config=prom_config))
        start = time.time()
        want = fault_pages(manifest)
        poll(lambda: want <= delivered(vm_hook) and want <= delivered(prom_hook), PAGE_TIMEOUT_S + FAULT_AFTER_S,
             interval=1, what=f"pages {sorted(want)} from both stacks "
                              f"(VictoriaMetrics: {sorted(delivered(vm_hook))}; Prometheus: {sorted(delivered(prom_hook))})")
        yield {"manifest": manifest, "vm": vm, "prom": prom, "agents": agents, "vm_hook": vm_hook,
               "prom_hook": prom_hook, "start": start, "end": time.time()}


def scraped_instances(agents: list[VMAgent]) -> list[set[str]]:
    """Each vmagent member's share: the instance labels of its active targets."""
    return [{t["labels"]["instance"] for t in agent.active_targets()} for agent in agents]


def test_vmagent_members_share_the_targets(stacks):
    """Together the members scrape every node, none twice. (Which member takes a node is a
    hash of its labels, random ports included: with 4 nodes one member may take them all,
    so that each member gets a share is shown over many targets below.)"""
    shares = scraped_instances(stacks["agents"])
    assert sum(len(s) for s in shares) == NODES, shares
    assert set().union(*shares) == {f"node-{i:04d}:9400" for i in range(NODES)}
    up = stacks["vm"].query('sum(up{job="rankscope"})')
    assert float(up[0]["value"][1]) == NODES


def test_vmagent_members_each_take_a_share_of_many_targets():
    """Over 64 targets, each of two members scrapes a non-empty share; together all of them,
    none twice (an empty share has odds of 2**-63). The targets are closed ports on
    loopback and the remote write goes nowhere: only the assignment is looked at."""
    closed = "127.0.0.1:1"
    instances = {f"node-{i:04d}:9400" for i in range(64)}
    scrape = {"global": {"scrape_interval": "1h"},
              "scrape_configs": [{"job_name": "sharding", "static_configs": [
                  {"targets": [closed], "labels": {"instance": name}} for name in sorted(instances)]}]}
    with contextlib.ExitStack() as stack:
        agents = [stack.enter_context(VMAgent(scrape, remote_write=f"http://{closed}/api/v1/write",
                                              members=MEMBERS, member=k)) for k in range(MEMBERS)]
        poll(lambda: sum(len(s) for s in scraped_instances(agents)) >= len(instances), 30, interval=0.2,
             what="both members' targets loaded")
        shares = scraped_instances(agents)
    assert all(shares), shares
    assert sum(len(s) for s in shares) == len(instances)
    assert set().union(*shares) == instances


def test_the_faults_page_the_same_way_on_both(stacks):
    """The straggler, the NaN and the hang page naming the right rank, through the same
    receivers, on VictoriaMetrics as on Prometheus; neither stack pages anything else."""
    want = fault_pages(stacks["manifest"])
    assert delivered(stacks["vm_hook"]) == want
    assert delivered(stacks["prom_hook"]) == want


def _resolve(api, uid: str, run: str, start: float, end: float) -> dict[str, str]:
    import re
    values = {"__rate_interval": f"{4 * STEP_S}s", "__interval": f"{STEP_S}s", "__interval_ms": str(STEP_S * 1000)}
    for v in DASHBOARDS[uid]["templating"]["list"]:
        if v["type"] == "datasource":
            values[v["name"]] = v["current"]["value"]
        elif v["type"] == "query":
            m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", v["query"]["query"].strip())
            found = api(f"label/{m.group(2)}/values", **{"match[]": interpolate(m.group(1), values),
                                                          "start": str(start), "end": str(end)})
            assert found, f"{uid}: variable {v['name']} has no values"
            values[v["name"]] = run if v["name"] == "run" else v.get("allValue") or ".*"
    return values


def test_every_dashboard_query_returns_data_from_victoriametrics(stacks):
    start, end = stacks["start"], stacks["end"]
    steps = math.ceil((end - start) / STEP_S)
    # The straggler's run for every panel, and the hang's run for the panels that show a hang.
    runs = [f["run"] for f in stacks["manifest"]["faults"].values()]
    missing, differ = [], []
    for target in all_targets():
        has = {}
        for name in ("vm", "prom"):
            server = stacks[name]
            found = False
            for run in dict.fromkeys(runs):
                expr = interpolate(target.expr, _resolve(server.api, target.uid, run, start, end))
                if target.instant:
                    data = server.api("query", query=expr, time=str(end))
                else:
                    data = server.api("query_range", query=expr, start=str(end - steps * STEP_S), end=str(end),
                                      step=str(STEP_S))
                found = found or bool(data["result"])
            has[name] = found
        if has["vm"] != has["prom"]:
            differ.append((target.id, has))
        if not has["vm"] and (target.uid, target.panel) not in SIMULATOR_HAS_NO \
                and (target.uid, target.panel, target.ref) not in SIMULATOR_HAS_NO_QUERY:
            missing.append(target.id)
    assert not differ, f"data on one engine only: {differ}"
    assert not missing, f"no data from VictoriaMetrics: {missing}"


def test_exemptions_name_real_panels():
    panels = {(t.uid, t.panel) for t in all_targets()}
    assert set(SIMULATOR_HAS_NO) <= panels
    assert set(SIMULATOR_HAS_NO_QUERY) <= {(t.uid, t.panel, t.ref) for t in all_targets()}
