"""Every collective of every process group, end to end: real torchrun jobs of the
reference trainer in FSDP2 and 2-D (dp x tp) modes on gloo, their exporters,
and a real Prometheus loaded with the shipped rules at the fast drill thresholds.

* FSDP2: the all-gathers and reduce-scatters rankscope counts per step are
  those torch's CommDebugMode counts for the same steps (on gloo the backend
  runs a reduce-scatter as an all-reduce of the whole gradient, and the flight
  recorder records what ran: rankscope's ``all_reduce`` = CommDebugMode's
  reduce-scatters + all-reduces); all-gather bytes are the parameter shards
  times the world size. No alert fires in that healthy run, nor in a healthy
  2-D run.
* Two simulated nodes (two torchrun agents, their own metrics directories,
  node names and exporter ports, one Prometheus): a rank of node B that hangs
  before its backward, in FSDP2 mode and in 2-D mode, is named by
  RankscopeCollectiveBehind with node B, the process group and the op its
  peers wait in, within the fast rule's ``for:`` + 2 scrapes of the moment its
  peers had waited ``collective_behind_wait_seconds``, and the shipped
  Alertmanager routes it to the pager; no rank of node A is named, and
  nothing else pages for the run. A DDP hang pages HangSuspect only.
"""

from __future__ import annotations

import datetime
import json
import re
import time

import pytest
import yaml

from tests.helpers.jobs import REPO, TrainJob, free_port, wait_until
from tests.helpers.paging import alertmanager_config, render_rules
from tests.helpers.promstack import AlertmanagerServer, PrometheusServer, WebhookReceiver, firing_alerts

FAST = yaml.safe_load((REPO / "prometheus" / "fast.yaml").read_text())
WAIT_S = float(FAST["params"]["collective_behind_wait_seconds"])
SCRAPE_S = 1.0   # PrometheusServer's test scrape and evaluation interval
HIDDEN = 256     # the trainer's default width


@pytest.fixture(scope="module")
def fast_rules(tmp_path_factory):
    return render_rules(tmp_path_factory.mktemp("fast-rules"), fast=True)


def by_op(prom: PrometheusServer, metric: str, run: str, rank: str = "0") -> dict[str, float]:
    return {r["metric"]["op"]: float(r["value"][1])
            for r in prom.query(f'sum by (op) ({metric}{{run="{run}",rank="{rank}"}})')}


def alerts_fired(prom: PrometheusServer, run: str) -> list[dict]:
    """Every alert that was pending or firing for the run in the last 10 minutes."""
    return prom.query(f'max_over_time(ALERTS{{run="{run}"}}[10m])')


def layer_gather_bytes(world: int) -> int:
    """Bytes one all-gather of each fully_shard-ed linear layer moves, summed over the three layers:
    the world size times each rank's dim-0 shard (padded as FSDP2 pads), float32."""
    total = 0
    for fan_in, fan_out in ((32, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, 10)):
        rows = -(-fan_out // world)     # FSDP2 shards dim 0 into equal, padded chunks
        total += world * (rows * fan_in + rows) * 4
    return total


def test_fsdp2_counts_equal_comm_debug_mode_bytes_match_the_shards_and_no_alert_fires(fast_rules):
    steps = 30
    with TrainJob(nproc=2, steps=steps, extra_args=["--parallelism", "fsdp2", "--comm-debug", "--eval-every",
                                                    "100000", "--step-delay", "0.02"]) as job, \
            PrometheusServer(targets=[f"127.0.0.1:{job.port}"], rule_files=fast_rules) as prom:
        assert job.wait(timeout=150) == 0, job.log()[-3000:]
        expected = json.loads(re.search(r"^comm-debug: (.*)$", job.log(), re.M).group(1))
        step, evaluation = expected["step"], expected["eval"]
        assert step["times"] == steps and evaluation["times"] == 1
        # The exporter still serves the finished ranks' counters; wait for a scrape that has the final ones.
        counts = wait_until(lambda: (c := by_op(prom, "rankscope_process_group_collectives_total", job.run_id))
                            and c.get("barrier") and c, timeout=30, what="final process-group counts")
        nbytes = by_op(prom, "rankscope_process_group_collective_bytes_total", job.run_id)
        bus_nbytes = by_op(prom, "rankscope_process_group_collective_bus_bytes_total", job.run_id)
        fired = alerts_fired(prom, job.run_id)
    gathers = step["_allgather_base_"] + evaluation["_allgather_base_"]
    assert counts["all_gather"] == gathers
    assert (counts["all_gather"] - evaluation["_allgather_base_"]) / steps == step["_allgather_base_"] / steps == 6
    # gloo: FSDP2's reduce-scatter goes over the wire as an all-reduce (and is recorded so).
    assert step["_reduce_scatter_base_"] / steps == 3
    assert counts["all_reduce"] == step["_reduce_scatter_base_"] + step["all_reduce"] + evaluation["allreduce_"]
    assert counts["barrier"] == 1        # the trainer's last barrier
    assert set(counts) == {"all_gather", "all_reduce", "barrier"}
    # Each all-gather moves one layer's shards; the three layers are gathered equally often.
    assert nbytes["all_gather"] == gathers // 3 * layer_gather_bytes(2)
    # Reduce-scatters (as all-reduces) move each layer's whole gradient: the same bytes, plus a few small all-reduces.
    reduce_scatter_bytes = step["_reduce_scatter_base_"] // 3 * layer_gather_bytes(2)
    assert reduce_scatter_bytes <= nbytes["all_reduce"] <= reduce_scatter_bytes + 1024
    # Bus bytes, as nccl-tests counts them for a group of 2: all_gather (n-1)/n, all_reduce 2(n-1)/n.
    assert bus_nbytes == {"all_gather": nbytes["all_gather"] / 2, "all_reduce": nbytes["all_reduce"], "barrier": 0}
    assert fired == [], [a["metric"] for a in fired]


def test_healthy_2d_run_fires_no_alert_and_names_its_mesh_groups(fast_rules):
    with TrainJob(nproc=4, steps=30, extra_args=["--parallelism", "2d", "--eval-every", "100000",
                                                 "--step-delay", "0.02"], env={"OMP_NUM_THREADS": "1"}) as job, \
            PrometheusServer(targets=[f"127.0.0.1:{job.port}"], rule_files=fast_rules) as prom:
        assert job.wait(timeout=150) == 0, job.log()[-3000:]
        groups = wait_until(lambda: {(r["metric"]["rank"], r["metric"]["group"], r["metric"]["group_id"])
                                     for r in prom.query(f'rankscope_process_group_collectives_total'
                                                         f'{{run="{job.run_id}",op="all_gather"}}')},
                            timeout=30, what="2-D groups")
        fired = alerts_fired(prom, job.run_id)
    labels = {g for _, g, _ in groups}
    assert {"tp", "dp"} <= labels <= {"tp", "dp", "default"}
    # Two tp groups and two dp groups, each the same group_id on both of its ranks.
    for role in ("tp", "dp"):
        members: dict[str, set[str]] = {}
        for rank, g, gid in groups:
            if g == role:
                members.setdefault(gid, set()).add(rank)
        assert sorted(map(len, members.values())) == [2, 2], (role, members)
    assert fired == [], [a["metric"] for a in fired]


@pytest.mark.parametrize("mode", ["fsdp2", "2d"])
def test_hang_on_node_b_pages_naming_its_rank_node_group_and_op(mode, fast_rules, tmp_path):
    nproc = 1 if mode == "fsdp2" else 2
    culprit = str(2 * nproc - 1)           # the last rank: on node B
    rdzv = free_port()
    run = f"behind-{mode}-{rdzv}"
    args = ["--parallelism", mode, "--step-delay", "0.05", "--hang-at", "30", "--eval-every", "100000"]
    jobs = [TrainJob(nproc=nproc, steps=2000, run_id=run, extra_args=args, metrics_dir=tmp_path / f"m{i}",
                     nodes=(2, i, rdzv), env={"RANKSCOPE_NODE": f"node-{'ab'[i]}", "OMP_NUM_THREADS": "1"})
            for i in range(2)]
    with jobs[0], jobs[1], WebhookReceiver() as hook, \
            AlertmanagerServer(config_text=alertmanager_config(hook)) as am, \
            PrometheusServer(targets=[f"127.0.0.1:{j.port}" for j in jobs], rule_files=fast_rules,
                             alertmanager=am.address) as prom:
        def firing():
            alerts = [a for a in prom.alerts() if a["labels"]["alertname"] == "RankscopeCollectiveBehind"
                      and a["labels"].get("run") == run]
            return alerts if alerts and all(a["state"] == "firing" for a in alerts) else None

        alerts = wait_until(firing, timeout=120, what="RankscopeCollectiveBehind firing")
        # When the peers' wait crossed the bar: the earliest in-flight start of the run, plus the bar.
        started = min(float(r["value"][1]) for r in prom.query(
            f'rankscope_process_group_in_flight_started_timestamp_seconds{{run="{run}"}} > 0'))
        others = [a for a in prom.alerts() if a["labels"].get("run") == run
                  and a["labels"]["alertname"] != "RankscopeCollectiveBehind" and a["labels"]["severity"] == "critical"]
        # The page: delivered to the pager receiver by the shipped Alertmanager routes.
        pages = wait_until(lambda: [a for d in hook.snapshot() if d.path == "/page"
                                    for a in firing_alerts(d) if a["labels"].get("run") == run],
                           timeout=30, what="the page")
        for job in jobs:   # the hang is real: the job is still running
            assert job.proc.poll() is None, job.log()[-2000:]
    assert {(p["labels"]["alertname"], p["labels"]["rank"], p["labels"]["node"]) for p in pages} == \
        {("RankscopeCollectiveBehind", culprit, "node-b")}, [p["labels"] for p in pages]
    for a in alerts:
        labels = a["labels"]
        assert (labels["rank"], labels["node"]) == (culprit, "node-b"), labels
        # FSDP2 over the whole world runs on the default group, named by its mesh dimension.
        assert labels["group"] in ({"dp_shard"} if mode == "fsdp2" else {"tp", "dp"}), labels
        op = re.search(r"who wait in (\w+) \(for", a["annotations"]["description"])
        assert op and op.group(1) in ("all_gather", "all_reduce", "reduce_scatter"), a["annotations"]["description"]
        assert re.search(r"is seq \d+, \d+ behind its peers", a["annotations"]["description"]), a["annotations"]
    active = min(datetime.datetime.fromisoformat(a["activeAt"].replace("Z", "+00:00")).timestamp() for a in alerts)
    latency = active - (started + WAIT_S)
    print(f"{mode}: CollectiveBehind pending {latency:.2f} s after the peers' wait crossed {WAIT_S:.0f} s; "
          f"firing after the rule's for:")
    # Pending within 2 scrape intervals of the crossing (a scrape, then an evaluation), plus one
    # interval for a late scrape or evaluation on this shared 2-core machine; firing `for:` later.
    assert latency <= 3 * SCRAPE_S, latency
    assert others == [], [o["labels"] for o in others]


def test_ddp_hang_pages_hang_suspect_and_collective_behind_stays_quiet(fast_rules):
    """DDP's all-reduces are in the flight recorder too: the same hang is seen by both rules,
    and only HangSuspect, the rank-state suspect, pages (one page per hang)."""
    with TrainJob(nproc=2, steps=2000, extra_args=["--step-delay", "0.05", "--hang-at", "30"]) as job, \
            PrometheusServer(targets=[f"127.0.0.1:{job.port}"], rule_files=fast_rules) as prom:
        wait_until(lambda: any(a["labels"]["alertname"] == "RankscopeHangSuspect" and a["state"] == "firing"
                               for a in prom.alerts()), timeout=120, what="HangSuspect firing")
        # The flight recorder sees the same hang: rank 0 waits, rank 1 is behind its group ...
        wait_until(lambda: prom.query(f'rankscope_process_group_last_enqueued_seq{{run="{job.run_id}",rank="1"}}'
                                      f' < on (run, group_id) group_left () '
                                      f'rankscope_process_group_last_enqueued_seq{{run="{job.run_id}",rank="0"}}'),
                   timeout=30, what="rank 1 behind rank 0")
        time.sleep(2 * SCRAPE_S + float(FAST["for"]["RankscopeCollectiveBehind"][:-1]))
        # ... but CollectiveBehind was never even pending.
        assert prom.query(f'max_over_time(ALERTS{{run="{job.run_id}",alertname="RankscopeCollectiveBehind"}}[10m])') \
            == []


@pytest.mark.parametrize("script, args", [
    ("overhead.py", ["--parallelism", "fsdp2", "--rounds", "12", "--hidden", "256", "--no-tracing"]),
    ("flight_recorder.py", []),
])
def test_benchmarks_run_quick(script, args):
    """The FSDP2 overhead variant and the flight-recorder cost benchmark still run (no timing judged)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(REPO / "tests" / "benchmarks" / script), "--quick", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    if script == "overhead.py":
        assert figures["parallelism"] == "fsdp2"
        reader = figures["ranks"]["0"]["process_group_reader"]
        assert reader["entries_read"] > 0 and reader["longest_slice_cpu_ms"] > 0
    else:
        assert figures["reader_longest_slice_cpu_ms"] > 0 and figures["server_cpu_ms_per_fetch"] > 0
        assert "Only ProcessGroup" in figures["completion_hook_gloo"]


def test_a_pipeline_hang_in_a_group_that_carries_sends_names_its_culprit_and_no_healthy_stage(fast_rules, tmp_path):
    """Three pipeline stages whose world group carries their sends and receives and an all-reduce;
    the middle stage stops before an all-reduce (outside any collective rankscope times). The
    group's status numbers every op: the middle stage, which sends and receives twice as much,
    read far ahead of its waiting peers, and the waiting stages behind it. From the entries'
    collective numbers the middle stage is the one behind: named; the healthy stages are not."""
    from tests.helpers.adapter_jobs import PagedJob
    from tests.helpers.userjob import UserJob

    job = UserJob("pipeline_hang.py", "--hang-rank", "1", "--hang-step", "30", nproc=3, tmp_path=tmp_path,
                  name="pipeline-hang")
    with PagedJob(job, fast_rules) as paged:
        paged.wait_for_page("RankscopeCollectiveBehind", "1", timeout=150)

        def described() -> str | None:
            alerts = [a for a in paged.prometheus.alerts() if a["labels"]["alertname"] == "RankscopeCollectiveBehind"
                      and a["labels"].get("run") == job.run_id]
            text = " ".join(a["annotations"]["description"] for a in alerts)
            return text if "1 behind its peers" in text else None

        # The entries' numbers are as fresh as the rank's last read of its ring (1-10 s apart; at
        # once for a rank whose collective stays in flight): the culprit's, stale, first reads
        # further behind, then exactly one collective behind.
        wait_until(described, timeout=30, what="the culprit one collective behind")
        time.sleep(3 * SCRAPE_S)   # any page for another rank would have come by now
        pages = {(a["labels"]["alertname"], a["labels"].get("rank")) for d in paged.hook.snapshot()
                 if d.path == "/page" for a in firing_alerts(d) if a["labels"].get("run") == job.run_id}
        assert job.proc.poll() is None, job.log()[-2000:]   # the hang is real
    assert pages == {("RankscopeCollectiveBehind", "1")}, pages
