"""Divergence between replicas, end to end: real 4-rank torchrun jobs -> the node exporter ->
Debian's Prometheus (fast rules) -> Alertmanager -> a webhook receiver.

Each fault drill makes one rank's replicated weights leave the others' with the reference
trainer's fault flags, and waits for the RankscopeReplicaDiverged page that names it (and
no other rank):

1. a bit flipped in one weight of rank 2 of a DDP job after the optimizer step of step 200
   (a check step at the default K of 100): its first differing check is step 200, and only
   its weights differ (its reduced gradients agree);
2. rank 2 runs step 200 under ``no_sync()``: its reduced gradients differ too;
3. rank 2 starts from weights 1e-6 off the others' (a checkpoint of its own, loaded after
   DDP's broadcast): named at the first check, step 0;
4. an HSDP job (2 replicas x 2 shards) with a flip in rank 3's shard after step 200: with two
   replicas of the shard, ranks 1 and 3 are both named, as a tie, with their shard
   (dp_shard=1); shard 0's replicas are not.

Healthy DDP, HSDP, FSDP2 and tensor-parallel jobs, with dropout and each rank its own data,
checked every 10 steps: their replicas are compared (agreement 1 in Prometheus) and nothing
pages. Fault-to-page times are printed and recorded; docs/alerting.md's table states them.
"""

from __future__ import annotations

import concurrent.futures
import time
import traceback
from dataclasses import dataclass, field

import pytest

from tests.drills.test_alert_drills import (PAGE_TIMEOUT, START_TIMEOUT, Stack, _describe, _watched_job,  # noqa: F401
                                            fast_rules, watch_healthy_to_its_end)
from tests.helpers.jobs import TrainJob
from tests.helpers.promstack import Delivery, firing_alerts

NPROC = 4
STEPS = 400
STEP_DELAY = "0.05"
FAULT_STEP = 200           # a check step at the default replica_check_every (100)
ALERT = "RankscopeReplicaDiverged"


@dataclass(frozen=True)
class ReplicaDrill:
    name: str
    args: tuple[str, ...]
    named: tuple[str, ...]          # the ranks the page must name, and no other
    fault_step: int | None          # the step the fault follows; None: from the start


DRILLS = (
    ReplicaDrill("bit_flip", ("--flip-bit-at", str(FAULT_STEP), "--fault-rank", "2"), ("2",), FAULT_STEP),
    ReplicaDrill("no_sync", ("--no-sync-at", str(FAULT_STEP), "--fault-rank", "2"), ("2",), FAULT_STEP),
    ReplicaDrill("perturbed_resume", ("--resume-perturbed", "1e-6", "--fault-rank", "2"), ("2",), None),
    ReplicaDrill("hsdp_shard_flip", ("--parallelism", "hsdp", "--flip-bit-at", str(FAULT_STEP), "--fault-rank", "3"),
                 ("1", "3"), FAULT_STEP),
)
HEALTHY = ("ddp", "hsdp", "fsdp2", "2d")


@dataclass
class ReplicaResult:
    name: str
    run: str
    alerts: list[dict] = field(default_factory=list)   # the page's ReplicaDiverged alerts of this run
    fault_to_page_s: float | None = None
    agreement: list[dict] = field(default_factory=list)
    deliveries: list[Delivery] = field(default_factory=list)
    prometheus_alerts: list[dict] = field(default_factory=list)
    error: str | None = None


def _step_of(samples, rank: str) -> float:
    return next((s.value for s in samples if s.name == "rankscope_step" and s.labels.get("rank") == rank), -1)


def run_replica_drill(drill: ReplicaDrill, rules_dir) -> ReplicaResult:
    run_id = f"replica-{drill.name}"
    result = ReplicaResult(drill.name, run_id)
    try:
        with Stack(rules_dir) as stack, \
                TrainJob(nproc=NPROC, steps=STEPS, run_id=run_id,
                         extra_args=["--step-delay", STEP_DELAY, "--workers", "0", *drill.args]) as job:
            prom = _watched_job(stack, job)
            try:
                if drill.fault_step is None:
                    t_fault = time.time()   # from the start: measured from Prometheus's first scrape
                else:
                    job.wait_for(lambda samples: _step_of(samples, drill.named[-1]) >= drill.fault_step - 1,
                                 timeout=START_TIMEOUT, what="the fault step")
                    t_fault = time.time()

                def names_all(d: Delivery) -> bool:
                    ranks = {a["labels"].get("rank") for a in firing_alerts(d, ALERT)
                             if a["labels"].get("run") == run_id}
                    return d.path == "/page" and set(drill.named) <= ranks

                try:
                    delivery = stack.hook.wait_for(names_all, timeout=PAGE_TIMEOUT)
                finally:
                    result.deliveries = stack.hook.snapshot()
                    result.prometheus_alerts = prom.alerts()
            finally:
                prom.__exit__(None, None, None)
            result.fault_to_page_s = max(delivery.received_at - t_fault, 0.0)
            result.alerts = [a for d in result.deliveries for a in firing_alerts(d, ALERT)
                             if a["labels"].get("run") == run_id]
    except Exception:  # noqa: BLE001 - reported by the drill's own test
        result.error = traceback.format_exc()
    return result


def run_healthy(parallelism: str, rules_dir) -> ReplicaResult:
    run_id = f"replica-healthy-{parallelism}"
    result = ReplicaResult(f"healthy_{parallelism}", run_id)
    try:
        with Stack(rules_dir) as stack, \
                TrainJob(nproc=NPROC, steps=240, run_id=run_id, env={"RANKSCOPE_REPLICA_CHECK_EVERY": "10"},
                         extra_args=["--step-delay", STEP_DELAY, "--workers", "0", "--parallelism", parallelism,
                                     "--dropout", "0.1"]) as job:
            def agreement(prom) -> None:
                result.agreement = prom.query(
                    f'max_over_time(group:rankscope_replica_ranks:agreement_ratio{{run="{run_id}"}}[5m])')
            watch_healthy_to_its_end(stack, job, result, nproc=NPROC, measure=agreement)
    except Exception:  # noqa: BLE001
        result.error = traceback.format_exc()
    return result


@pytest.fixture(scope="module")
def replica_results(fast_rules, request) -> dict[str, ReplicaResult]:
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {d.name: pool.submit(run_replica_drill, d, fast_rules) for d in DRILLS}
        futures.update({f"healthy_{p}": pool.submit(run_healthy, p, fast_rules) for p in HEALTHY})
        results = {name: f.result() for name, f in futures.items()}
    lines = ["", "rankscope replica drills (fault -> Alertmanager webhook delivery):"]
    for d in DRILLS:
        r = results[d.name]
        lines.append(f"  {d.name:<18} " + (f"{r.fault_to_page_s:6.1f} s  naming rank(s) {', '.join(d.named)}"
                                            if r.fault_to_page_s is not None else "FAILED (see its test)"))
    capmanager = request.config.pluginmanager.getplugin("capturemanager")
    with capmanager.global_and_fixture_disabled():
        print("\n".join(lines), flush=True)
    return results


def _description(r: ReplicaResult, rank: str) -> str:
    return next(a["annotations"]["description"] for a in r.alerts if a["labels"]["rank"] == rank)


@pytest.mark.parametrize("drill", DRILLS, ids=[d.name for d in DRILLS])
def test_the_rank_that_left_its_replicas_is_paged_and_no_other(drill: ReplicaDrill, replica_results, record_property):
    r = replica_results[drill.name]
    assert r.error is None and r.alerts, _describe(r)
    record_property("fault_to_page_seconds", round(r.fault_to_page_s, 2))
    assert {a["labels"]["rank"] for a in r.alerts} == set(drill.named), _describe(r)
    assert all(a["labels"]["severity"] == "critical" for a in r.alerts)
    assert r.fault_to_page_s < PAGE_TIMEOUT


def test_a_flipped_bit_is_dated_to_its_step_and_blamed_on_the_weights_alone(replica_results):
    r = replica_results["bit_flip"]
    assert r.alerts, _describe(r)
    description = _description(r, "2")
    assert f"Its first check that differed (within 6h): step {FAULT_STEP}." in description, description
    assert "3 of the 4 ranks of its group that checked this step agree" in description, description
    assert "Its reduced gradients agree with its replicas'" in description, description
    assert "begins at parameter 2.weight" in description, description


def test_a_skipped_gradient_sync_shows_in_the_gradients(replica_results):
    r = replica_results["no_sync"]
    assert r.alerts, _describe(r)
    description = _description(r, "2")
    assert f"step {FAULT_STEP}." in description and "Its reduced gradients differ too" in description, description


def test_a_perturbed_resume_is_named_at_the_first_check(replica_results):
    r = replica_results["perturbed_resume"]
    assert r.alerts, _describe(r)
    assert "Its first check that differed (within 6h): step 0." in _description(r, "2")


def test_a_flip_in_one_shard_of_two_replicas_names_both_and_the_shard(replica_results):
    r = replica_results["hsdp_shard_flip"]
    assert r.alerts, _describe(r)
    for rank, other in (("1", "3"), ("3", "1")):
        alert = next(a for a in r.alerts if a["labels"]["rank"] == rank)
        assert alert["labels"]["shard"] == "dp_shard=1" and alert["labels"]["replicas"] == "dp_replicate"
        assert "the majority cannot tell which is right" in _description(r, rank)
        assert f"(also: rank {other})" in _description(r, rank)


@pytest.mark.parametrize("parallelism", HEALTHY)
def test_healthy_replicas_agree_and_page_nothing(parallelism, replica_results):
    r = replica_results[f"healthy_{parallelism}"]
    assert r.error is None, _describe(r)
    assert [a for a in r.prometheus_alerts if a["labels"].get("alertname") == ALERT] == [], _describe(r)
    assert not [d for d in r.deliveries if firing_alerts(d, ALERT)], _describe(r)
    if parallelism == "fsdp2":   # every parameter sharded, none replicated: nothing to compare
        assert r.agreement == [], r.agreement
    else:
        assert r.agreement and all(float(s["value"][1]) == 1.0 for s in r.agreement), r.agreement
