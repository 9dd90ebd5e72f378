"""End-to-end fault drills: real torchrun job -> real exporter -> Debian's Prometheus
(fast rule variant) -> Debian's Alertmanager (the shipped routes and inhibitions)
-> a webhook receiver in the test.

Each drill injects one fault with the reference trainer's fault flags and waits
for the page (critical -> /page) or chat message (warning -> /chat) that names
the run and the faulty rank; a healthy run of the same length must deliver
nothing. The fault-to-page time of every drill is printed (even without -s)
and recorded as a junit property.

Prometheus starts once the job's exporter answers and the fault must come after
its first scrape. Fault time: the first exporter poll (every 0.25 s) after that
which shows the faulty rank at the step just before the faulty one (for the
slow rank, slow from its first step: the first poll once it has stepped and
Prometheus scrapes); page time: arrival of the matching webhook POST.

Drills run two at a time (the CI machine has 2 cores): a module fixture runs
them all in a thread pool and each test checks its own result.
"""

from __future__ import annotations

import concurrent.futures
import copy
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from urllib.parse import urlparse

import pytest
import yaml

from prometheus import generate
from tests.helpers.jobs import TrainJob
from tests.helpers.promstack import (AlertmanagerServer, Delivery, PrometheusServer, WebhookReceiver,
                                     firing_alerts, poll)

ROOT = Path(__file__).resolve().parents[2]
ALERTMANAGER_YML = ROOT / "prometheus" / "alertmanager.yml"
FAST_OVERRIDE = ROOT / "prometheus" / "fast.yaml"

NPROC = 2
FAULT_RANK = "1"          # the trainer's default fault rank: the last one
STEPS = 400
STEP_DELAY = "0.05"       # seconds per step on every rank: ~20 steps/s, a steady, cheap run
FAULT_STEP = 200          # >= 10 s into training: after Prometheus's first scrape (~5 s after its start)
PAGE_TIMEOUT = 60.0       # fault to delivery, upper bound
START_TIMEOUT = 180.0     # job start to the fault step: torch start-up is slow on a loaded 2-core machine
PARALLEL_DRILLS = 2


@dataclass(frozen=True)
class Drill:
    name: str
    fault_args: tuple[str, ...]
    alertname: str
    path: str                       # /page (critical) or /chat (warning)
    fault_step: int | None = FAULT_STEP   # None: the fault acts from the first step on


DRILLS = (
    Drill("nan_loss", ("--nan-loss-at", str(FAULT_STEP)), "RankscopeNonFiniteLoss", "/page"),
    Drill("oom", ("--oom-at", str(FAULT_STEP)), "RankscopeOutOfMemory", "/page"),
    Drill("hang", ("--hang-at", str(FAULT_STEP)), "RankscopeHangSuspect", "/page"),
    Drill("slow_rank", ("--slow-rank-delay", "0.15"), "RankscopeStraggler", "/chat", fault_step=None),
    Drill("rank_killed", ("--crash-at", str(FAULT_STEP)), "RankscopeRankDown", "/page"),
    Drill("rank_exception", ("--raise-at", str(FAULT_STEP)), "RankscopeRankDown", "/page"),
)


@dataclass
class DrillResult:
    drill: str
    run: str
    delivery: Delivery | None = None
    alert: dict | None = None
    fault_to_page_s: float | None = None
    error: str | None = None
    deliveries: list[Delivery] = field(default_factory=list)
    prometheus_alerts: list[dict] = field(default_factory=list)
    final_states: dict[str, str] = field(default_factory=dict)   # rank -> state, read from the exporter at the end


def drill_alertmanager_config(hook: WebhookReceiver) -> str:
    """The shipped alertmanager.yml (routes, inhibitions) with the webhooks pointed at the
    test receiver and the grouping delays cut to a second."""
    config = copy.deepcopy(yaml.safe_load(ALERTMANAGER_YML.read_text()))
    config["route"].update(group_wait="1s", group_interval="1s")
    for route in config["route"]["routes"]:
        route["group_wait"] = "1s"
    for receiver in config["receivers"]:
        for webhook in receiver.get("webhook_configs", []):
            webhook["url"] = hook.url(urlparse(webhook["url"]).path)
    return yaml.safe_dump(config, sort_keys=False)


def _rank_sample(samples, name: str, rank: str) -> float | None:
    for s in samples:
        if s.name == name and s.labels.get("rank") == rank:
            return s.value
    return None


def _fault_reached(drill: Drill) -> Callable:
    """Predicate on exporter samples: the faulty rank completed the step before the fault,
    or its process is gone (a rank publishes its step every publish interval, so a SIGKILL
    can hide the last few steps). For a fault acting from the start: its first step."""
    if drill.fault_step is None:
        return lambda samples: (_rank_sample(samples, "rankscope_steps_total", FAULT_RANK) or 0) >= 1
    return lambda samples: ((_rank_sample(samples, "rankscope_step", FAULT_RANK) or -1) >= drill.fault_step - 1
                            or _rank_sample(samples, "rankscope_rank_up", FAULT_RANK) == 0)


class Stack:
    """Webhook receiver + Alertmanager + Prometheus (fast rules) around one training job."""

    def __init__(self, rules_dir: Path):
        self.rules = [rules_dir / generate.RECORDING_FILE, rules_dir / generate.ALERTS_FILE]

    def __enter__(self):
        self.hook = WebhookReceiver().__enter__()
        try:
            self.am = AlertmanagerServer(config_text=drill_alertmanager_config(self.hook)).__enter__()
        except BaseException:
            self.hook.__exit__(None, None, None)
            raise
        return self

    def prometheus(self, job) -> PrometheusServer:
        target = urlparse(job.url).netloc
        return PrometheusServer(targets=[target], rule_files=self.rules, alertmanager=self.am.address)

    def __exit__(self, *exc):
        self.am.__exit__(*exc)
        self.hook.__exit__(*exc)


def _watched_job(stack: Stack, job) -> PrometheusServer:
    """Start Prometheus once the node exporter answers (so no target-down in between) and
    return it after its first successful scrape."""
    try:
        job.wait_for(lambda samples: True, timeout=START_TIMEOUT, what="the node exporter to answer")
    except TimeoutError:
        raise TimeoutError(f"no exporter; job log:\n{job.log()[-2000:]}") from None
    prom = stack.prometheus(job).__enter__()
    try:
        prom.wait_for_scrape(timeout=30)
    except BaseException:
        prom.__exit__(None, None, None)
        raise
    return prom


def watch_healthy_to_its_end(stack: Stack, job, result, nproc: int = NPROC,
                             measure: Callable[[PrometheusServer], None] = lambda prom: None) -> None:
    """A healthy job under Prometheus to its end, and a few evaluations (1 s each) after Prometheus
    has scraped its finished ranks, so end-of-run transitions are judged too; then what Prometheus
    holds and Alertmanager delivered go into ``result`` (``measure`` reads more first)."""
    prom = _watched_job(stack, job)
    try:
        returncode = job.wait(timeout=START_TIMEOUT + 60)
        assert returncode == 0, f"the healthy job failed (rc {returncode}):\n{job.log()[-2000:]}"
        poll(lambda: len(prom.query(f'rankscope_rank_state{{run="{result.run}",state="finished"}} == 1'))
             == nproc, timeout=30, what="finished ranks scraped")
        observe_until = time.monotonic() + 5
        while time.monotonic() < observe_until:
            if [a for a in prom.alerts() if a["state"] == "firing"] or stack.hook.snapshot():
                break
            time.sleep(0.5)
        measure(prom)
        result.prometheus_alerts = prom.alerts()
        result.deliveries = stack.hook.snapshot()
    finally:
        prom.__exit__(None, None, None)


def run_fault_drill(drill: Drill, rules_dir: Path) -> DrillResult:
    run_id = f"drill-{drill.name}"
    result = DrillResult(drill.name, run_id)
    try:
        with Stack(rules_dir) as stack, \
                TrainJob(nproc=NPROC, steps=STEPS, run_id=run_id,
                         extra_args=["--step-delay", STEP_DELAY, *drill.fault_args]) as job:
            prom = _watched_job(stack, job)
            try:
                if drill.fault_step is not None and _fault_reached(drill)(job.scrape()):
                    raise AssertionError(f"the fault (step {drill.fault_step}) came before Prometheus scraped; "
                                         "raise FAULT_STEP")
                try:
                    job.wait_for(_fault_reached(drill), timeout=START_TIMEOUT, what="the fault step")
                except TimeoutError:
                    steps = [(x.labels.get("rank"), x.value) for x in job.scrape() if x.name == "rankscope_step"]
                    raise TimeoutError(f"fault step not reached; steps now {steps}; job log:\n"
                                       f"{job.log()[-3000:]}") from None
                t_fault = time.time()

                def is_page(d: Delivery) -> bool:
                    return d.path == drill.path and any(
                        a["labels"].get("rank") == FAULT_RANK and a["labels"].get("run") == run_id
                        for a in firing_alerts(d, drill.alertname))

                try:
                    delivery = stack.hook.wait_for(is_page, timeout=PAGE_TIMEOUT)
                finally:
                    result.deliveries = stack.hook.snapshot()
                    result.prometheus_alerts = prom.alerts()
                    result.final_states = {s.labels["rank"]: s.labels["state"] for s in job.scrape()
                                           if s.name == "rankscope_rank_state" and s.value == 1}
            finally:
                prom.__exit__(None, None, None)
            result.delivery = delivery
            result.alert = next(a for a in firing_alerts(delivery, drill.alertname)
                                if a["labels"].get("rank") == FAULT_RANK)
            result.fault_to_page_s = max(delivery.received_at - t_fault, 0.0)
    except Exception:  # noqa: BLE001 - reported by the drill's own test
        result.error = traceback.format_exc()
    return result


def run_healthy_drill(rules_dir: Path) -> DrillResult:
    """A run of the same length without a fault: Prometheus must hold no firing alert and
    Alertmanager must deliver nothing, up to and after the job's end."""
    run_id = "drill-healthy"
    result = DrillResult("healthy", run_id)
    try:
        with Stack(rules_dir) as stack, \
                TrainJob(nproc=NPROC, steps=STEPS, run_id=run_id, extra_args=["--step-delay", STEP_DELAY]) as job:
            watch_healthy_to_its_end(stack, job, result)
    except Exception:  # noqa: BLE001
        result.error = traceback.format_exc()
    return result


@pytest.fixture(scope="module")
def fast_rules(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fast-rules")
    generate.main(["--override", str(FAST_OVERRIDE), "--out", str(out)])
    return out


@pytest.fixture(scope="module")
def drill_results(fast_rules, request) -> dict[str, DrillResult]:
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_workers=PARALLEL_DRILLS) as pool:
        futures = {d.name: pool.submit(run_fault_drill, d, fast_rules) for d in DRILLS}
        futures["healthy"] = pool.submit(run_healthy_drill, fast_rules)
        results = {name: f.result() for name, f in futures.items()}
    total = time.monotonic() - started
    lines = ["", "rankscope alert drills (fault -> Alertmanager webhook delivery):"]
    for d in DRILLS:
        r = results[d.name]
        outcome = (f"{r.fault_to_page_s:6.1f} s  {d.alertname} -> {d.path} naming rank {FAULT_RANK}"
                   if r.fault_to_page_s is not None else "   FAILED (see its test)")
        lines.append(f"  {d.name:<12} {outcome}")
    healthy = results["healthy"]
    lines.append(f"  {'healthy':<12} {len(healthy.deliveries)} deliveries, "
                 f"{sum(a['state'] == 'firing' for a in healthy.prometheus_alerts)} firing alerts, "
                 f"{sum(a['state'] == 'pending' for a in healthy.prometheus_alerts)} pending"
                 + (f" (error: {healthy.error.strip().splitlines()[-1]})" if healthy.error else ""))
    lines.append(f"  total drill wall time {total:.0f} s ({PARALLEL_DRILLS} in parallel)")
    capmanager = request.config.pluginmanager.getplugin("capturemanager")
    with capmanager.global_and_fixture_disabled():  # print even without -s
        print("\n".join(lines), flush=True)
    return results


def _describe(r: DrillResult) -> str:
    return (f"{r.error or ''}\ndeliveries: {[(d.path, [a['labels'] for a in d.alerts]) for d in r.deliveries]}"
            f"\nprometheus alerts: {[(a['labels'], a['state']) for a in r.prometheus_alerts]}")


@pytest.mark.parametrize("drill", DRILLS, ids=[d.name for d in DRILLS])
def test_fault_pages_naming_run_and_rank(drill: Drill, drill_results, record_property):
    r = drill_results[drill.name]
    assert r.error is None and r.alert is not None, _describe(r)
    record_property("fault_to_page_seconds", round(r.fault_to_page_s, 2))
    labels, annotations = r.alert["labels"], r.alert["annotations"]
    assert labels["run"] == r.run and labels["rank"] == FAULT_RANK
    assert labels["severity"] == ("critical" if drill.path == "/page" else "warning")
    assert f"run {r.run}" in annotations["description"] and f"rank {FAULT_RANK}" in annotations["description"]
    assert f"node {labels['node']}" in annotations["description"]
    assert annotations["runbook_url"].endswith("#" + drill.alertname.lower())
    assert r.fault_to_page_s < PAGE_TIMEOUT


def test_hang_page_names_the_collective_peers_wait_in(drill_results):
    r = drill_results["hang"]
    assert r.alert is not None, _describe(r)
    # DDP's gradient all-reduce is where the healthy rank waits for the hung one.
    assert "while its peers wait in all_reduce" in r.alert["annotations"]["description"]


def test_a_rank_that_raises_pages_with_its_exception_and_no_rank_reads_finished(drill_results):
    """The exception ends rank 1; torchrun then tears rank 0 down (a gloo error or its
    SIGTERM). Neither completed its loop, so neither may read ``finished``."""
    r = drill_results["rank_exception"]
    assert r.alert is not None, _describe(r)
    assert "it raised ValueError" in r.alert["annotations"]["description"]
    assert r.final_states and "finished" not in r.final_states.values(), r.final_states


def test_healthy_run_fires_nothing(drill_results):
    r = drill_results["healthy"]
    assert r.error is None, _describe(r)
    assert [a for a in r.prometheus_alerts if a["state"] == "firing"] == [], _describe(r)
    assert r.deliveries == [], _describe(r)
