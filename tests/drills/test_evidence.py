"""Issue 31: evidence on the page. A user's DDP loop (tests/loops/evidence_job.py, 2 ranks,
gloo) stops making progress on rank 1 in one of the ways real jobs do; the real exporter
captures that rank's evidence once, serves it, and the real Prometheus and Alertmanager put
the link on the page.

Each job runs once (a JobPool, two at a time) and returns what the tests read. The
paged jobs render the fast rules with `for:` long enough for the capture (the exporter's
janitor sees a state within 2 s and a capture takes about a second) to be in the first
notification; production's `for:` is 30 s (RankDown) and more, so there it always is.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from prometheus import generate
from tests.helpers.jobs import free_port, rankscope_command, select, value, wait_until
from tests.helpers.paging import FAST_OVERRIDE, alertmanager_config
from tests.helpers.promstack import (AlertmanagerServer, PrometheusServer, WebhookReceiver, firing_alerts,
                                     http_get_json)
from tests.helpers.userjob import JobPool, UserJob

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# The exporter's state thresholds, cut from 30/10/10 s so that a job reaches them in seconds.
FAST_STATES = {"RANKSCOPE_STUCK_AFTER_S": "3", "RANKSCOPE_SUSPECT_AFTER_S": "2", "RANKSCOPE_FROZEN_AFTER_S": "3"}
AT = "15"                        # the step at which rank 1 stops
START_S = 180.0                  # a job's start to its first steps on a loaded 2-core machine
PAGE_FOR = {"RankscopeHangSuspect": "10s", "RankscopeRankDown": "8s"}
LINK = re.compile(r"https?://\S+/evidence/\S+")


# -- reading what the exporter serves ------------------------------------------------------
def captures(job: UserJob) -> list[dict]:
    """The exporter's index of the captures it keeps."""
    try:
        return http_get_json(f"http://127.0.0.1:{job.port}/evidence")
    except OSError:
        return []


def capture_of(job: UserJob, rank: int, timeout: float = 60.0) -> dict:
    """Rank ``rank``'s newest capture (JSON), once there is one."""
    entry = wait_until(lambda: next((c for c in captures(job) if c["rank"] == rank), None), timeout=timeout,
                       what=f"evidence of rank {rank}")
    return http_get_json(f"http://127.0.0.1:{job.port}{entry['path']}?format=json")


def serving(job: UserJob, ranks: int = 2) -> list:
    """Wait for the job's exporter to serve every rank's first steps."""
    def stepping():
        try:
            samples = job.scrape()
        except OSError:
            return None
        return len([s for s in job.series(samples, "rankscope_step") if s.value > 0]) >= ranks and samples
    return wait_until(stepping, timeout=START_S, what="the job's first steps")


def pids(job: UserJob) -> dict[int, int]:
    wait_until(lambda: len(job.results()) == 2, timeout=START_S, what="every rank's pid")
    return {rank: r["pid"] for rank, r in job.results().items()}


def frames(capture: dict) -> list[list]:
    """Every frame [file, line, function] of the training thread of a capture."""
    stacks = capture["stacks"]
    return next(t["frames"] for t in stacks["threads"] if t["id"] == stacks["training_thread"])


def functions(capture: dict) -> list[str]:
    return [f[2] for f in frames(capture)]


# -- paging --------------------------------------------------------------------------------
def page_rules(out: Path) -> list[Path]:
    longer = out / "for.yaml"
    out.mkdir(parents=True, exist_ok=True)
    longer.write_text(yaml.safe_dump({"for": PAGE_FOR}))
    generate.main(["--override", str(FAST_OVERRIDE), "--override", str(longer), "--out", str(out)])
    return [out / generate.RECORDING_FILE, out / generate.ALERTS_FILE]


def page_for(jobs: list[UserJob], work: Path, alert: str, ranks: set[str], timeout: float = 120.0,
             then: Callable[[PrometheusServer], Any] | None = None) -> dict[str, Any]:
    """Start Prometheus on the jobs' exporters (already serving) with the shipped rules and
    Alertmanager routes; return rank -> the alert delivered firing for it, once ``alert`` has
    been delivered for every rank of ``ranks`` (each the first notification that carried it),
    and under "then" what ``then(prometheus)`` returned, called before the servers stop."""
    with WebhookReceiver() as hook, AlertmanagerServer(config_text=alertmanager_config(hook)) as am, \
            PrometheusServer(targets=[f"127.0.0.1:{j.port}" for j in jobs], rule_files=page_rules(work / "rules"),
                             alertmanager=am.address, scrape_interval="1s", evaluation_interval="1s") as prom:
        prom.wait_for_scrape(timeout=30)
        paged: dict[str, dict] = {}

        def delivered() -> bool:
            for d in hook.snapshot():
                for a in firing_alerts(d, alert):
                    paged.setdefault(a["labels"].get("rank", ""), a)
            return ranks <= set(paged)
        wait_until(delivered, timeout=timeout, what=f"{alert} delivered for ranks {sorted(ranks)}")
        if then is not None:
            paged["then"] = then(prom)
        return paged


def links(alert: dict) -> list[str]:
    return LINK.findall(alert["annotations"]["description"])


# -- the jobs (on the pool's threads) ------------------------------------------------------
def loader_hang(work: Path) -> dict:
    # The waiting rank dumps torch's flight recorder after 3 s in the all-reduce: served with its evidence.
    env = {**FAST_STATES, "TORCH_FR_BUFFER_SIZE": "200", "RANKSCOPE_FLIGHT_RECORDER_AFTER_S": "3"}
    with UserJob("evidence_job.py", "loader_hang", "--at", AT, nproc=2, tmp_path=work, env=env) as job:
        job.start()
        serving(job)
        paged = page_for([job], work, "RankscopeHangSuspect", {"1"}, then=lambda prom: consoles(job, prom, work))
        link = links(paged["1"])
        peer = wait_until(lambda: (lambda c: c["collectives"]["flight_recorder"] and c)(capture_of(job, 0)),
                          timeout=30, what="rank 0's flight-recorder dump listed with its evidence")
        base = f"http://127.0.0.1:{job.port}{peer['path']}"
        with urllib.request.urlopen(f"{base}/flight-recorder/{peer['collectives']['flight_recorder'][0]}") as r:
            dump = pickle.loads(r.read())
        outside = [status(f"http://127.0.0.1:{job.port}/evidence/{slug}/0/flight-recorder/{name}")
                   for slug, name in ((peer["run_dir"], "..%2F..%2Fexporter.json"), ("..", "ranks"),
                                      (peer["run_dir"], "nccl_trace_rank_1"))]
        return {"page": paged["1"], "links": link, "culprit": http_get_json(link[0] + "?format=json") if link else None,
                "peer": peer, "dump": dump, "outside": outside, "port": job.port, "consoles": paged["then"],
                "html": urllib.request.urlopen(base).read().decode()}


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def consoles(job: UserJob, prom: PrometheusServer, work: Path) -> dict:
    """What `rankscope top` (on the exporter) and `rankscope report` (on Prometheus) show of the run."""
    command = rankscope_command()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_")}
    top = subprocess.run([*command, "top", job.url, "--once", "--run", job.run_id], capture_output=True, text=True,
                         timeout=60, env={**env, "COLUMNS": "250"})
    out = work / "report.html"
    report = subprocess.run([*command, "report", "--prometheus", prom.url, "--run", job.run_id, "--out", str(out)],
                            capture_output=True, text=True, timeout=120, env=env)
    facts = re.search(r"<script type='application/json' id='rankscope-report'>(.*?)</script>",
                      out.read_text() if out.exists() else "", re.S)
    return {"top": top.stdout + top.stderr, "report": json.loads(facts.group(1).replace("<\\/", "</")) if facts
            else report.stderr}


def raised(work: Path) -> dict:
    with UserJob("evidence_job.py", "raise", "--at", "40", nproc=2, tmp_path=work, env=FAST_STATES) as job:
        job.start()
        serving(job)
        paged = page_for([job], work, "RankscopeRankDown", {"0", "1"})
        link = links(paged["1"])
        return {"pages": paged, "links": link, "culprit": http_get_json(link[0] + "?format=json") if link else None,
                "rc": job.wait(timeout=60, check=False)}


def two_nodes(work: Path) -> dict:
    """One job as two simulated nodes (static rendezvous on loopback), each with its own
    exporter, metrics directory and node name; rank 1 (node-b) hangs in its loader."""
    run, rendezvous = f"two-nodes-{free_port()}", free_port()
    nodes = [UserJob("evidence_job.py", "loader_hang", "--at", AT, nproc=1, tmp_path=work, name=name, run_id=run,
                     metrics_dir=work / name, env={**FAST_STATES, "RANKSCOPE_NODE": name})
             for name in ("node-a", "node-b")]
    try:
        for node_rank, job in enumerate(nodes):
            command = job.command
            at = command.index("--standalone")
            command[at:at + 1] = ["--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", "127.0.0.1",
                                  "--master-port", str(rendezvous)]
            job.start(command)
        for job in nodes:
            serving(job, ranks=1)
        paged = page_for(nodes, work, "RankscopeHangSuspect", {"1"})
        link = links(paged["1"])
        return {"page": paged["1"], "links": link, "ports": [j.port for j in nodes],
                "kept": [sorted(p.name for p in j.metrics_dir.glob("*/evidence/rank-*.json")) for j in nodes],
                "culprit": http_get_json(link[0] + "?format=json") if link else None}
    finally:
        for job in nodes:
            job.__exit__(None, None, None)


def regex_spin(work: Path) -> dict:
    with UserJob("evidence_job.py", "regex_spin", "--at", AT, nproc=2, tmp_path=work, env=FAST_STATES) as job:
        job.start()
        serving(job)
        culprit = capture_of(job, 1)
        frozen = wait_until(lambda: job.state(job.scrape(), rank=1) == "frozen", timeout=30, what="rank 1 frozen")
        return {"culprit": culprit, "frozen": frozen}


def sigstop(work: Path) -> dict:
    with UserJob("evidence_job.py", "sigstop", nproc=2, tmp_path=work, env=FAST_STATES) as job:
        job.start()
        serving(job)
        pid = pids(job)[1]
        os.kill(pid, signal.SIGSTOP)
        try:
            culprit = capture_of(job, 1)
            before = {s.labels["rank"]: s.value for s in job.series(job.scrape(), "rankscope_step")}
        finally:
            os.kill(pid, signal.SIGCONT)
        after = wait_until(lambda: (lambda now: all(now.get(r, 0) > v + 5 for r, v in before.items()) and now)(
            {s.labels["rank"]: s.value for s in job.series(job.scrape(), "rankscope_step")}),
            timeout=60, what="both ranks training again after SIGCONT")
        return {"culprit": culprit, "before": before, "after": after}


def loss_hang(work: Path) -> dict:
    with UserJob("evidence_job.py", "loss_hang", "--at", AT, nproc=2, tmp_path=work, env=FAST_STATES) as job:
        job.start()
        serving(job)
        culprit = capture_of(job, 1)

        def refined(samples):   # the capture is read at the exporter's next pass
            return job.state(samples, rank=1) == "stuck" and samples
        samples = wait_until(lambda: refined(job.scrape()), timeout=30, what="rank 1 stuck (not in a collective)")
        return {"culprit": culprit, "samples": samples, "job": job.run_id,
                "states": {r: job.state(samples, rank=r) for r in (0, 1)}}


def own_handler(work: Path) -> dict:
    env = {**FAST_STATES, "RANKSCOPE_STACK_SIGNAL": "SIGUSR2"}
    with UserJob("evidence_job.py", "own_handler", "--at", AT, "--steps", "40", nproc=2, tmp_path=work,
                 env=env) as job:
        job.start()
        serving(job)
        pid = pids(job)[1]
        culprit = capture_of(job, 1)        # stuck at --at, waiting for its own handler to run
        os.kill(pid, signal.SIGUSR2)        # the job's own use of its signal
        rc = job.wait(timeout=90, check=False)
        return {"culprit": culprit, "rc": rc, "offers": {r: res["stacks"] for r, res in job.results().items()},
                "ran": (job.out / "own-handler-ran1").exists(), "log": job.log()}


JOBS = {"loader_hang": loader_hang, "raise": raised, "two_nodes": two_nodes, "regex_spin": regex_spin,
        "sigstop": sigstop, "loss_hang": loss_hang, "own_handler": own_handler}


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    with JobPool(2) as pool:
        for name, job in JOBS.items():
            pool.submit(name, job, tmp_path_factory.mktemp(name))
        yield pool


# -- the tests -----------------------------------------------------------------------------
def test_a_rank_hung_in_its_loader_is_paged_with_a_link_to_its_stack(ran):
    r = ran.get("loader_hang")
    assert len(r["links"]) == 1 and f":{r['port']}/evidence/" in r["links"][0], r["page"]["annotations"]
    culprit = r["culprit"]
    assert culprit["rank"] == 1 and culprit["trigger"] in ("suspect", "stuck")
    assert "slow_shard_read" in functions(culprit), culprit["stacks"]["text"]
    assert culprit["stacks"]["training_thread_in"] == "user code"
    assert culprit["process"]["state"] == "S"
    peer = r["peer"]   # rank 0 waits in the all-reduce DDP launched in its backward
    assert peer["collectives"]["in_flight"].get("all_reduce", 0) > 0, peer["collectives"]
    assert peer["stacks"]["training_thread_in"] in ("backward", "collective"), peer["stacks"]["text"]


def test_the_waiting_peers_flight_recorder_dump_is_served_with_its_evidence(ran):
    r = ran.get("loader_hang")
    entries = r["dump"]["entries"]
    assert entries and any("all_reduce" in e["profiling_name"] for e in entries), entries[-1]
    name = r["peer"]["collectives"]["flight_recorder"][0]
    assert f"0/flight-recorder/{name}'" in r["html"]
    assert r["outside"] == [404, 404, 404]   # nothing but the rank's own dumps, by name


def test_top_and_the_report_show_where_the_culprit_is(ran):
    consoles = ran.get("loader_hang")["consoles"]
    top = consoles["top"]
    assert re.search(r"rank 1 \((suspect|stuck)\) in slow_shard_read \(evidence_job.py:\d+\)", top), top
    report = consoles["report"]
    assert isinstance(report, dict), report   # the report's facts, or why it was not written
    (culprit,) = [c for c in report["evidence"] if c["rank"] == 1]
    assert culprit["where"][0].startswith("slow_shard_read") and culprit["url"].endswith("/1"), culprit


def test_a_rank_that_raised_is_paged_as_the_first_failure_with_its_traceback(ran):
    r = ran.get("raise")
    first, torn_down = r["pages"]["1"]["annotations"]["description"], r["pages"]["0"]["annotations"]["description"]
    assert "it raised ValueError" in first and "It is the run's first failure: the cause." in first, first
    assert "It failed after rank 1" in torn_down and "a consequence of it" in torn_down, torn_down
    assert "first failure: the cause" not in torn_down
    failure = r["culprit"]["failure"]
    assert failure["exception"] == "ValueError"
    assert "check_batch" in failure["traceback"] and "labels out of range" in failure["traceback"], failure
    assert r["culprit"]["trigger"] == "failed" and r["culprit"]["process"] == {"gone": True}
    assert r["rc"] != 0


def test_the_page_of_a_hang_across_two_nodes_links_to_the_culprits_node(ran):
    r = ran.get("two_nodes")
    node_a, node_b = r["ports"]
    assert len(r["links"]) == 1 and f"127.0.0.1:{node_b}/evidence/" in r["links"][0], r["page"]["annotations"]
    assert r["culprit"]["node"] == "node-b" and "slow_shard_read" in functions(r["culprit"])
    kept_a, kept_b = r["kept"]
    assert all(name.startswith("rank-0-") for name in kept_a), kept_a   # node-a holds only its own rank's
    assert any(name.startswith("rank-1-") for name in kept_b), kept_b


def test_a_rank_spinning_with_the_gil_held_is_frozen_and_its_stack_shows_the_regex(ran):
    r = ran.get("regex_spin")
    culprit = r["culprit"]
    # Its peer's wait names it the hang suspect (2 s) before its heartbeat is old enough to
    # read frozen (3 s): one episode, captured once, whichever came first.
    assert culprit["trigger"] in ("suspect", "frozen") and r["frozen"]
    files = [f[0].replace("\\", "/") for f in frames(culprit)]
    assert any("/re/" in f or f.endswith("/re.py") for f in files), culprit["stacks"]["text"]
    assert "spin_in_regex" in functions(culprit)
    assert culprit["process"]["state"] == "R" and culprit["process"]["cpu_advancing"] is True


def test_a_stopped_rank_reports_its_state_without_being_waited_on(ran):
    r = ran.get("sigstop")
    culprit = r["culprit"]
    assert culprit["stacks"]["source"] == "stopped", culprit["stacks"]
    assert culprit["process"]["state"] == "T" and culprit["process"]["cpu_advancing"] is False
    assert culprit["capture_s"] < 3.0, culprit["capture_s"]
    assert all(r["after"][k] > v for k, v in r["before"].items())   # continued, it trains on


def test_a_rank_hung_in_its_loss_code_is_not_counted_inside_the_all_reduce(ran):
    r = ran.get("loss_hang")
    culprit, samples = r["culprit"], r["samples"]
    assert "compute_loss" in functions(culprit) and culprit["stacks"]["training_thread_in"] == "user code"
    assert r["states"] == {0: "stuck_in_collective", 1: "stuck"}
    assert value(samples, "rankscope_hang_suspect", run=r["job"], rank="1") == 1
    assert all(s.value == 0 for s in select(samples, "rankscope_collective_in_flight_seconds", run=r["job"], rank="1"))


def test_a_job_that_handles_the_stack_signal_keeps_its_handler(ran):
    r = ran.get("own_handler")
    assert r["ran"] and r["rc"] == 0, r["log"][-2000:]
    assert all("SIGUSR2" in offer.get("unavailable", "") for offer in r["offers"].values()), r["offers"]
    assert r["culprit"]["stacks"]["source"] == "unavailable" and "SIGUSR2" in r["culprit"]["stacks"]["note"]
    assert r["log"].count("the job handles SIGUSR2 itself") == 2, r["log"][-2000:]   # once per rank
