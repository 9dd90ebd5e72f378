"""Every dashboard query against a real Prometheus that scraped real torchrun jobs.

Grafana cannot run here, so this does what Grafana would: it resolves the
template variables with the variable queries (run, then node and rank, as
label-values look-ups), substitutes them and Grafana's built-ins into every
panel query, and runs each one (range queries over the jobs' lifetime with a
1 s step, instant queries at the end) against Debian's Prometheus 2.42. That
Prometheus scraped, every second and with the repository's recording and
alert rules loaded (the shipped expressions and thresholds, every group
evaluated every RULE_INTERVAL instead of every 15 s to 1 min: the fixture
waits for two evaluations of every group after the faults), real jobs of
the reference trainer:

- MAIN_RUN trains, then its last rank gets a loss spike, a NaN loss and
  finally hangs before a collective (so divergence counters move, an alert
  fires, the peer waits in a collective and the hang suspect is named);
- OOM_RUN's last rank raises an out-of-memory error in a step and dies;
- PIPELINE_RUN is a 4-rank pipeline (2 stages, the second holding 1.6x the layers):
  the per-stage panels.

Every query must execute without error and, unless listed in NO_DATA_HERE
with its reason, return data. Panels that only have data during a fault are
pointed at the run with that fault in FAULT_RUN.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import time
import urllib.parse
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest

from prometheus import generate
from rankscope.exporter.catalog import RANK_STATES
from tests.helpers.jobs import TrainJob
from tests.helpers.promstack import PrometheusServer

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = {p.stem: json.loads(p.read_text()) for p in sorted((ROOT / "grafana" / "dashboards").glob("*.json"))}
RULE_INTERVAL = "5s"

MAIN_RUN = "dashboards-main"
HANG_AT = 160  # step before whose collective MAIN_RUN's rank 1 hangs
OOM_RUN = "dashboards-oom"
PIPELINE_RUN = "dashboards-pipeline"   # 4 ranks, 2 pipeline stages, the second 1.6x the first
SCRAPE_INTERVAL_S = 1
# Grafana's $__rate_interval is max($__interval + scrape interval, 4 x scrape interval).
BUILTINS = {
    "__rate_interval": f"{4 * SCRAPE_INTERVAL_S}s",
    "__interval": f"{SCRAPE_INTERVAL_S}s",
    "__interval_ms": str(SCRAPE_INTERVAL_S * 1000),
}

# Exporter thresholds, shortened so the hang is classified within seconds
# (defaults: stuck after 30 s, suspect after 10 s). The exporter is started by
# the job and inherits its environment.
FAST_EXPORTER_ENV = {"RANKSCOPE_STUCK_AFTER_S": "3", "RANKSCOPE_SUSPECT_AFTER_S": "2"}

# Panels whose data exists only in the OOM run; everything else is checked on MAIN_RUN.
FAULT_RUN = {
    ("rankscope-memory-devices", "OOM events"): OOM_RUN,
    ("rankscope-memory-devices", "Ranks that hit OOM"): OOM_RUN,
    ("rankscope-run-overview", "Ranks down"): OOM_RUN,
    ("rankscope-ranks", "Compute time per step per stage"): PIPELINE_RUN,
    ("rankscope-ranks", "Stages against each other"): PIPELINE_RUN,
    # Recorded every 30 s from ranks that train: MAIN_RUN hangs within seconds of its start.
    ("rankscope-ranks", "Slowest rank of the step over the median (load imbalance)"): PIPELINE_RUN,
}

NO_GPU = "no GPU on this machine: the exporter has no NVML series (checked: the query executes)"
CPU_ALLOCATOR = ("CPU run: the CUDA caching-allocator gauges are only set on CUDA devices (device total is 0, "
                 "so the headroom rule, which needs total > 0, is empty too); checked: the query executes")
# (dashboard uid, panel title, refId or None for every query of the panel) -> why it has no data here.
NO_DATA_HERE = {
    ("rankscope-memory-devices", "GPU utilisation", None): NO_GPU,
    ("rankscope-memory-devices", "GPU memory used", None): NO_GPU,
    ("rankscope-memory-devices", "GPU power", None): NO_GPU,
    ("rankscope-memory-devices", "GPU temperature", None): NO_GPU,
    ("rankscope-memory-devices", "GPU SM clock", None): NO_GPU,
    ("rankscope-memory-devices", "GPU throttling", None): NO_GPU,
    ("rankscope-memory-devices", "GPU errors", None): NO_GPU,
    ("rankscope-memory-devices", "Last XID per GPU", None): NO_GPU,
    ("rankscope-memory-devices", "Device memory per rank", "A"): CPU_ALLOCATOR,  # allocated
    ("rankscope-memory-devices", "Device memory per rank", "B"): CPU_ALLOCATOR,  # peak allocated
    ("rankscope-memory-devices", "Device memory per rank", "C"): CPU_ALLOCATOR,  # reserved
    ("rankscope-memory-devices", "Memory headroom", "A"): CPU_ALLOCATOR,  # device headroom
    ("rankscope-run-overview", "MFU (model FLOPs utilisation)", None):
        "CPU run: no device peak FLOP/s (rankscope_device_peak_flops exists only on a GPU whose peak is known), "
        "so no MFU, although the trainer counts model FLOPs; the panel shows its no-data text; checked: the "
        "query executes",
    ("rankscope-communication", "Collective duration p50 per process group", None):
        "gloo records no collective durations in torch's flight recorder (NCCL with timing on does; "
        "tests/gpu/test_gpu.py); checked: the query executes",
    ("rankscope-communication", "Bus bandwidth per process group", None):
        "gloo records no collective durations in torch's flight recorder, so no per-group bandwidth (NCCL with "
        "timing on does); checked: the query executes",
    ("rankscope-communication", "Bus bandwidth per rank and op", "B"):
        "the run's median counts a rank once its 5 m bandwidth window lies within its launch (a window that "
        "reaches back to the launch holds start-up's collectives): this job has run less than that; the per-rank "
        "query A has data; checked: the query executes",
    ("rankscope-communication", "Link throughput against its speed", "B"):
        "this machine's network devices report no speed (a virtual NIC's sysfs speed reads -1; the namespaced "
        "fault-matrix nodes' veths read 10000); checked: the query executes",
    ("rankscope-communication", "Queues held back and credit waits", "B"):
        "no InfiniBand port on this machine (the fault matrix's slow links show the queue, query A); checked: "
        "the query executes",
}


@dataclass(frozen=True)
class Target:
    uid: str
    panel: str
    ref: str
    expr: str
    instant: bool

    @property
    def id(self) -> str:
        return f"{self.uid}/{self.panel}/{self.ref}"

    def no_data_reason(self) -> str | None:
        return NO_DATA_HERE.get((self.uid, self.panel, self.ref)) or NO_DATA_HERE.get((self.uid, self.panel, None))


def all_targets() -> list[Target]:
    out = []
    for uid, d in DASHBOARDS.items():
        for p in d["panels"]:
            for t in p.get("targets", []):
                out.append(Target(uid, p["title"], t["refId"], t["expr"], bool(t.get("instant"))))
    return out


def all_variable_queries() -> list[tuple[str, str, str]]:
    """(dashboard uid, variable name, query) for every query variable."""
    return [(uid, v["name"], v["query"]["query"]) for uid, d in DASHBOARDS.items()
            for v in d["templating"]["list"] if v["type"] == "query"]


def interpolate(expr: str, values: dict[str, str]) -> str:
    """Grafana-style: $name and ${name} are replaced when the variable exists ("$1" stays)."""
    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        return values.get(name, m.group(0))
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", sub, expr)


def regex_multi(values: list[str]) -> str:
    """Grafana's Prometheus formatting of a multi-value variable: (a|b), regex-escaped for a PromQL string."""
    return "(" + "|".join(re.escape(v).replace("\\", "\\\\") for v in values) + ")"


class QueryRunner:
    """Grafana's side of the conversation with Prometheus, for one time window."""

    def __init__(self, prom: PrometheusServer, start: float, end: float):
        self.prom, self.start, self.end = prom, start, end
        self._variables: dict[tuple[str, str, bool], dict[str, str]] = {}

    def label_values(self, query: str, values: dict[str, str]) -> list[str]:
        m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", query.strip())
        assert m, f"not a label_values() query: {query}"
        selector, label = interpolate(m.group(1), values), m.group(2)
        return self.prom.api(f"label/{label}/values", **{"match[]": selector, "start": str(self.start),
                                                         "end": str(self.end)})

    def variables(self, uid: str, run: str, multi_as_all: bool = False) -> dict[str, str]:
        """Resolve the dashboard's variables in order, as Grafana does on load (run fixed to ``run``).

        Multi-value variables get every value found, formatted as Grafana does,
        or with ``multi_as_all`` the "All" value.
        """
        key = (uid, run, multi_as_all)
        if key not in self._variables:
            self._variables[key] = self._resolve(uid, run, multi_as_all)
        return self._variables[key]

    def _resolve(self, uid: str, run: str, multi_as_all: bool) -> dict[str, str]:
        values = dict(BUILTINS)
        for v in DASHBOARDS[uid]["templating"]["list"]:
            if v["type"] == "datasource":
                values[v["name"]] = v["current"]["value"]
            elif v["type"] == "query":
                found = self.label_values(v["query"]["query"], values)
                assert found, f"{uid}: variable {v['name']} has no values"
                if v["name"] == "run":
                    assert run in found, f"{uid}: run {run} not among {found}"
                    values["run"] = run
                elif multi_as_all:
                    values[v["name"]] = v["allValue"]
                else:
                    values[v["name"]] = regex_multi(found)
        return values

    def run(self, target: Target, values: dict[str, str]) -> list[dict]:
        expr = interpolate(target.expr, values)
        assert "$" not in expr.replace('"$1"', ""), f"unsubstituted variable in {expr}"
        if target.instant:
            data = self.prom.api("query", query=expr, time=str(self.end))
        else:
            # The last point of the range is exactly `end`, so it sees everything the
            # fixture saw before it took `end` (a grid aligned on `start` may stop up
            # to one step earlier).
            steps = math.ceil((self.end - self.start) / SCRAPE_INTERVAL_S)
            data = self.prom.api("query_range", query=expr, start=str(self.end - steps * SCRAPE_INTERVAL_S),
                                 end=str(self.end), step=str(SCRAPE_INTERVAL_S))
        return data["result"]


def job_target(job: TrainJob) -> str:
    return urllib.parse.urlsplit(job.url).netloc


def _query_ok(prom: PrometheusServer, expr: str) -> bool:
    return bool(prom.query(expr))


def _every_group_evaluated_since(prom: PrometheusServer, t: float) -> bool:
    groups = prom.api("rules")["groups"]
    return bool(groups) and all(
        datetime.fromisoformat(g["lastEvaluation"].replace("Z", "+00:00")).timestamp() >= t for g in groups)


@pytest.fixture(scope="module")
def rule_files(tmp_path_factory) -> list[Path]:
    """The shipped rules, each group evaluated every RULE_INTERVAL."""
    out = tmp_path_factory.mktemp("rules")
    (out / "intervals.yaml").write_text("".join(f"{key}: {RULE_INTERVAL}\n" for key in
                                                ("rule_interval", "warning_rule_interval", "slow_rule_interval")))
    generate.main(["--override", str(out / "intervals.yaml"), "--out", str(out)])
    return [out / generate.RECORDING_FILE, out / generate.ALERTS_FILE]


@pytest.fixture(scope="module")
def runner(rule_files):
    """Three real jobs, one Prometheus scraping them; yields once every fault is visible in Prometheus."""
    with contextlib.ExitStack() as stack:
        # MAIN_RUN: rank 1 is slow (so steps take ~50 ms and there is time to
        # scrape), spikes its loss, produces a NaN, then hangs before a collective.
        main = stack.enter_context(TrainJob(
            nproc=2, steps=2000, env=FAST_EXPORTER_ENV, run_id=MAIN_RUN,
            extra_args=["--slow-rank-delay", "0.05", "--loss-spike-at", "40",
                        "--nan-loss-at", "80", "--hang-at", str(HANG_AT)]))
        oom = stack.enter_context(TrainJob(
            nproc=2, steps=2000, env=FAST_EXPORTER_ENV, run_id=OOM_RUN,
            extra_args=["--step-delay", "0.05", "--oom-at", "80"]))
        pipeline = stack.enter_context(TrainJob(
            nproc=4, steps=2000, env=FAST_EXPORTER_ENV, run_id=PIPELINE_RUN,
            extra_args=["--parallelism", "pipeline", "--step-delay", "0.05", "--stage-cost", "1,1.6"]))
        start = time.time()
        prom = stack.enter_context(PrometheusServer(targets=[job_target(main), job_target(oom), job_target(pipeline)],
                                                    rule_files=rule_files,
                                                    scrape_interval=f"{SCRAPE_INTERVAL_S}s",
                                                    evaluation_interval=f"{SCRAPE_INTERVAL_S}s"))
        # Start-up can look like a hang for a moment (rank 0 waits in DDP's
        # initial broadcast while rank 1 is still importing), so every hang
        # condition is tied to a step past the injected faults.
        past = f'on (run) (min by (run) (rankscope_step{{run="{MAIN_RUN}"}}) >= {HANG_AT - 10})'
        faults = [
            f'rankscope_hang_suspect{{run="{MAIN_RUN}", rank="1"}} == 1 and {past}',
            f'rankscope_rank_state{{run="{MAIN_RUN}", rank="0", state="stuck_in_collective"}} == 1 and {past}',
            f'rankscope_collective_in_flight_seconds{{run="{MAIN_RUN}", rank="0"}} > 0 and {past}',
            f'ALERTS{{run="{MAIN_RUN}", alertname="RankscopeNonFiniteLoss"}}',
            f'rankscope_rank_up{{run="{OOM_RUN}", rank="1"}} == 0'
            f' and on (run, rank) rankscope_oom_total{{run="{OOM_RUN}"}} > 0',
            f'stage:rankscope_phase_seconds:compute_per_step_ratio{{run="{PIPELINE_RUN}", stage="1"}} > 1.3',
        ]
        for expr in faults:
            prom.wait_for(lambda e=expr: _query_ok(prom, e), timeout=120, what=expr)
        # Groups evaluate at their own offset in their own interval (15 s, 30 s, 1 m), and
        # a record may read another group's (the 1 m summaries read the 30 s compute per
        # step): two rounds of every group after the faults, so each record panels read
        # is computed from records that are themselves from after the faults.
        for round_ in ("first", "second"):
            since = time.time()
            prom.wait_for(lambda t=since: _every_group_evaluated_since(prom, t), timeout=90,
                          what=f"a {round_} evaluation of every rule group after the faults")
        yield QueryRunner(prom, start, time.time())


@pytest.mark.parametrize("uid,name,query", all_variable_queries(), ids=lambda x: x if isinstance(x, str) else "")
def test_variable_query_returns_values(runner, uid, name, query):
    values = runner.variables(uid, MAIN_RUN)  # resolves every variable; asserts each has values
    found = runner.label_values(query, values)
    assert found, f"{uid}: variable {name} is empty"
    if name == "run":
        assert {MAIN_RUN, OOM_RUN, PIPELINE_RUN} <= set(found)
    if name == "rank":
        assert set(found) == {"0", "1"}


@pytest.mark.parametrize("target", all_targets(), ids=lambda t: t.id)
def test_panel_query_returns_data(runner, target):
    run = FAULT_RUN.get((target.uid, target.panel), MAIN_RUN)
    for values in (runner.variables(target.uid, run), runner.variables(target.uid, run, multi_as_all=True)):
        result = runner.run(target, values)  # raises on any PromQL or API error
        reason = target.no_data_reason()
        if reason is None:
            assert result, f"{target.id} returned no data for run {run}: {interpolate(target.expr, values)}"


def test_exemptions_are_real():
    """Every exemption names an existing panel, so the list cannot silently outlive the dashboards."""
    panels = {(t.uid, t.panel, t.ref) for t in all_targets()} | {(t.uid, t.panel, None) for t in all_targets()}
    assert set(NO_DATA_HERE) <= panels
    assert {(u, p) for u, p in FAULT_RUN} <= {(t.uid, t.panel) for t in all_targets()}


def _target(uid: str, panel: str, ref: str = "A") -> Target:
    (found,) = [t for t in all_targets() if (t.uid, t.panel, t.ref) == (uid, panel, ref)]
    return found


def test_fault_panels_name_the_faulty_rank(runner):
    """The panels an on-call engineer reads in a hang or an OOM point at the rank that caused it (rank 1)."""
    main = runner.variables("rankscope-ranks", MAIN_RUN)
    suspects = runner.run(_target("rankscope-ranks", "Hang suspect (likely culprit)"), main)
    assert {r["metric"]["rank"] for r in suspects} == {"1"}, suspects

    # State timeline: the peer waits in the collective (code of stuck_in_collective) while rank 1 does not.
    states = runner.run(_target("rankscope-ranks", "Rank states"), main)
    last_code = {r["metric"]["rank"]: r["values"][-1][1] for r in states}
    last_state = {rank: RANK_STATES[int(float(code))] for rank, code in last_code.items()}
    assert last_state["0"] == "stuck_in_collective", last_state
    assert last_state["1"] != "stuck_in_collective", last_state

    # The stage panels name the heavier stage (1.6x the layers: ~160% against the other).
    stages = runner.run(_target("rankscope-ranks", "Stages against each other"),
                        runner.variables("rankscope-ranks", PIPELINE_RUN))
    last = {r["metric"]["stage"]: float(r["values"][-1][1]) for r in stages}
    assert set(last) == {"0", "1"} and 1.4 < last["1"] < 1.8, last

    oom = runner.variables("rankscope-memory-devices", OOM_RUN)
    hit = runner.run(_target("rankscope-memory-devices", "Ranks that hit OOM"), oom)
    assert {r["metric"]["rank"] for r in hit} == {"1"}, hit


def test_gpu_join_rank_side_is_present(runner):
    """The GPU panels join rankscope_gpu_* to ranks through rankscope_rank_info{gpu_uuid}.

    Without a GPU the device side is empty, so check the rank side here: one
    identity series per rank, with an empty gpu_uuid on a CPU run (which is
    why the GPU panels are empty for the right reason).
    """
    info = runner.prom.api("query", query=f'rankscope_rank_info{{run="{MAIN_RUN}"}}',
                           time=str(runner.end))["result"]
    assert {r["metric"]["rank"] for r in info} == {"0", "1"}, info
    assert all(r["metric"].get("gpu_uuid", "") == "" and r["metric"]["device"] == "cpu" for r in info), info
