"""--rank-histograms (rankscope.exporter.cardinality; docs/scaling.md, "Cardinality controls").

Against full mode, on the same rank files:

* ``sum-count`` and ``node-buckets`` serve no per-rank ``_bucket`` series;
  each per-rank histogram's ``_sum`` and ``_count`` are full mode's, value for
  value (by repr), and every other family (gauges, counters, the exporter's
  derived rank states) is identical;
* ``node-buckets`` adds ``rankscope_node_<histogram>``: the ranks' buckets,
  counts and sums added up per run, node (and op, group), no rank labels;
* the text parses with prometheus_client's text and OpenMetrics parsers and
  renders byte for byte as the library renders it;
* the scrape-time relabelling of docs/scaling.md drops exactly the per-rank
  buckets, and passes ``promtool check config``.

The fast tests write real rank files with ``rankscope.publishing.metrics.RankMetrics`` in
this process (ten ranks of two runs: one pid, one label set per rank) and
collect with ``RankCollector``. The integration tests run real rank processes,
real exporter processes in each mode (flag and environment variable) and a
real Prometheus scraping them.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
import yaml
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text
from prometheus_client.registry import Collector

from rankscope.contract import catalog as rank_catalog
from rankscope.contract.rundir import Registration, process_start_ticks, run_slug
from rankscope.exporter import catalog as exporter_catalog
from rankscope.exporter.cardinality import reduce_histograms
from rankscope.exporter.catalog import node_histogram_name
from rankscope.exporter.cli import build_parser, config_from_args
from rankscope.exporter.config import RANK_HISTOGRAM_MODES, ExporterConfig, ExporterConfigError
from rankscope.exporter.exposition import Renderer
from rankscope.exporter.ranks import RankCollector

REPO = Path(__file__).resolve().parents[3]
SCALING = REPO / "docs" / "scaling.md"
HISTOGRAMS = tuple(m.name for m in rank_catalog.RANK_METRICS if m.kind == "histogram")
# Derived from the time of the scrape: they differ between two collections.
TIME_DERIVED = {"rankscope_step_stalled_seconds", "rankscope_heartbeat_age_seconds",
                "rankscope_collective_in_flight_seconds", "rankscope_exporter_collect_duration_seconds"}
RUNS = {"job-a": ("node-a", 8), "job-b": ("node-a", 2)}


def write_rank(metrics_dir: Path, run: str, node: str, rank: int, world: int, steps: int = 40):
    """One rank's files, written as a Monitor writes them (RankMetrics), with every per-rank histogram used:
    step and data-wait durations, two collective ops, two process groups. Returns the RankMetrics."""
    from rankscope.publishing.metrics import RankMetrics

    run_dir = metrics_dir / run_slug(run)
    run_dir.mkdir(parents=True, exist_ok=True)
    pid = os.getpid()
    ident = {"run": run, "rank": str(rank), "local_rank": str(rank), "node": node}
    Registration(run=run, rank=rank, local_rank=rank, node=node, world_size=world, local_world_size=world, pid=pid,
                 pid_start_ticks=process_start_ticks(pid), agent_pid=os.getppid(),
                 agent_start_ticks=process_start_ticks(os.getppid()), started_at=time.time(),
                 info={"process_id": str(pid)}).save(run_dir)
    m = RankMetrics(run_dir, ident)
    m.set_rank_info({**dict.fromkeys(rank_catalog.RANK_INFO_LABELS, ""), "process_id": str(pid),
                     "world_size": str(world), "local_world_size": str(world)})
    pg = m.family("rankscope_process_group_collective_duration_seconds")
    pg_count = m.family("rankscope_process_group_collectives_total")
    for step in range(steps):
        # Spread over the buckets, different per rank; a straggler on rank 3.
        d = 0.004 * (1 + step % 17) * (1 + rank / 7) * (3 if rank == 3 else 1)
        now = time.time()
        m.steps.inc()
        m.step.set(step)
        m.step_duration.observe(d)
        m.step_last.set(d)
        m.step_ts.set(now)
        m.heartbeat.set(now)
        m.data_wait.observe(d / (5 + step % 4))
        m.observed["loss"].set(1.0 / (step + 1 + rank))
        for phase, share in (("data", 0.1), ("forward", 0.3), ("backward", 0.5), ("optimizer", 0.1)):
            m.phase[phase].inc(d * share)
        m.wall["productive"].inc(d)
        for op, scale in (("all_reduce", 0.001), ("broadcast", 0.0003)):
            c = m.collective(op)
            c.duration.observe(scale * (1 + (step * (rank + 1)) % 9))
            c.bytes.inc(4096)
            c.last.set(scale)
        for group in ("default", "tp"):
            m.child(pg, {"group": group, "op": "all_reduce"}).observe(0.0002 * (1 + (step + rank) % 13))
            m.child(pg_count, {"group": group, "group_id": "0" if group == "default" else "1",
                               "op": "all_reduce"}).inc()
    return m


@pytest.fixture(scope="module")
def metrics_dir(tmp_path_factory) -> Path:
    """Two runs on one node: 8 ranks and 2 ranks, all in this (live) process."""
    d = tmp_path_factory.mktemp("cardinality")
    for run, (node, world) in RUNS.items():
        for rank in range(world):
            write_rank(d, run, node, rank, world)
    return d


@pytest.fixture(scope="module")
def one_run_dir(tmp_path_factory) -> Path:
    """One run of 4 ranks. (With two runs the page has each family once per run, in every mode: the
    text format takes it, prometheus_client's OpenMetrics parser refuses the repeated family names.)"""
    d = tmp_path_factory.mktemp("one-run")
    for rank in range(4):
        write_rank(d, "job-a", "node-a", rank, 4, steps=20)
    return d


@functools.lru_cache(maxsize=None)
def collect(metrics_dir: Path, mode: str) -> list:
    """One collection per directory and mode (the files do not change; the tests only read)."""
    return list(RankCollector(ExporterConfig(directory=metrics_dir, nvml=False, rank_histograms=mode)).collect())


def samples(families) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in families for s in m.samples}


def canon(families, skip=TIME_DERIVED) -> list:
    return [(m.name, m.type, m.documentation, [(s.name, s.labels, repr(s.value)) for s in m.samples])
            for m in families if m.name not in skip]


class Frozen(Collector):
    def __init__(self, metrics):
        self.metrics = list(metrics)

    def collect(self):
        return self.metrics


def family_of(sample_name: str) -> str:
    return re.sub(r"_(bucket|sum|count)$", "", sample_name)


# -- the option -------------------------------------------------------------------------------------------------


def from_cli(argv: list[str], env: dict[str, str]) -> ExporterConfig:
    return config_from_args(build_parser().parse_args(argv), env)


def test_option_default_environment_flag_and_errors():
    assert RANK_HISTOGRAM_MODES == ("full", "sum-count", "node-buckets")
    assert from_cli([], {}).rank_histograms == "full"
    assert from_cli([], {"RANKSCOPE_RANK_HISTOGRAMS": "sum-count"}).rank_histograms == "sum-count"
    assert from_cli(["--rank-histograms", "node-buckets"],
                    {"RANKSCOPE_RANK_HISTOGRAMS": "sum-count"}).rank_histograms == "node-buckets"
    with pytest.raises(ExporterConfigError, match="^--rank-histograms: must be one of full, sum-count, "
                                                  "node-buckets, got 'none'"):
        from_cli(["--rank-histograms", "none"], {})
    with pytest.raises(ExporterConfigError, match="^RANKSCOPE_RANK_HISTOGRAMS: must be one of"):
        from_cli([], {"RANKSCOPE_RANK_HISTOGRAMS": "Full"})
    assert "--rank-histograms {full,sum-count,node-buckets}" in build_parser().format_help()


# -- in process: the same files, three modes ------------------------------------------------------------------------


def test_full_mode_is_the_merge_unchanged(metrics_dir):
    full = collect(metrics_dir, "full")
    again = reduce_histograms(full, "full")
    assert again == full and all(a is b for a, b in zip(again, full))
    assert any(s.name.endswith("_bucket") and "rank" in s.labels for m in full for s in m.samples)


@pytest.mark.parametrize("mode", ["sum-count", "node-buckets"])
def test_reduced_modes_against_full(metrics_dir, mode):
    full, reduced = collect(metrics_dir, "full"), collect(metrics_dir, mode)
    full_hist = [m for m in full if m.name in HISTOGRAMS]
    assert {m.name for m in full_hist} == set(HISTOGRAMS)
    # No per-rank bucket is served.
    assert not [s for m in reduced for s in m.samples if s.name.endswith("_bucket") and "rank" in s.labels]
    # Every gauge and counter (rank-written and exporter-derived) is full mode's, in full mode's order.
    assert canon([m for m in reduced if m.type in ("gauge", "counter")]) == \
        canon([m for m in full if m.type in ("gauge", "counter")])
    # Each per-rank histogram: a summary of full mode's _sum and _count, value for value, order kept.
    per_rank = [m for m in reduced if m.name in HISTOGRAMS]
    assert [m.name for m in per_rank] == [m.name for m in full_hist]
    for ours, theirs in zip(per_rank, full_hist):
        assert ours.type == "summary" and ours.documentation == theirs.documentation
        assert [(s.name, s.labels, repr(s.value)) for s in ours.samples] == \
            [(s.name, s.labels, repr(s.value)) for s in theirs.samples if not s.name.endswith("_bucket")]
    node = [m for m in reduced if m.name.startswith(exporter_catalog.NODE_HISTOGRAM_PREFIX)]
    assert bool(node) == (mode == "node-buckets")
    # Nothing else appears or goes.
    assert len(reduced) == len(full) + len(node)


def test_node_histograms_are_the_sums_of_the_ranks(metrics_dir):
    full = collect(metrics_dir, "full")
    # One family per run (as every family of a run's files).
    node = [m for m in collect(metrics_dir, "node-buckets") if m.name.startswith(exporter_catalog.NODE_HISTOGRAM_PREFIX)]
    assert sorted(m.name for m in node) == sorted(node_histogram_name(h) for h in HISTOGRAMS for _ in RUNS)
    expected: dict[tuple, float] = defaultdict(float)
    ranks: dict[tuple, set] = defaultdict(set)
    for m in full:
        if m.name not in HISTOGRAMS:
            continue
        for s in m.samples:
            labels = {k: v for k, v in s.labels.items() if k not in ("rank", "local_rank")}
            key = (node_histogram_name(m.name) + s.name[len(m.name):], tuple(sorted(labels.items())))
            expected[key] += s.value
            ranks[key].add(s.labels["rank"])
    got = samples(node)
    assert set(got) == set(expected)
    for key, value in got.items():
        name, labels = key
        if name.endswith("_sum"):
            assert value == pytest.approx(expected[key], rel=1e-12)   # float seconds, added in another order
        else:
            assert value == expected[key]                             # counts: exact
    # Per run: the run's ranks only (8 and 2), every label set of the ranks (ops, groups) kept.
    step_inf = {dict(labels)["run"]: (v, ranks[(n, labels)]) for (n, labels), v in got.items()
                if n == "rankscope_node_step_duration_seconds_bucket" and dict(labels)["le"] == "+Inf"}
    assert step_inf == {"job-a": (8 * 40.0, {str(r) for r in range(8)}), "job-b": (2 * 40.0, {"0", "1"})}
    ops = {dict(labels)["op"] for n, labels in got if n == "rankscope_node_collective_duration_seconds_count"}
    assert ops == {"all_reduce", "broadcast"}
    groups = {dict(labels)["group"] for n, labels in got
              if n == "rankscope_node_process_group_collective_duration_seconds_count"}
    assert groups == {"default", "tp"}
    # Each node histogram is complete: cumulative buckets ending in +Inf == _count, as the catalog declares it.
    specs = exporter_catalog.BY_NAME
    for m in node:
        spec = specs[m.name]
        assert m.type == "histogram" == spec.kind and m.documentation == spec.help
        for s in m.samples:
            assert set(s.labels) - {"le"} == set(spec.label_names), (m.name, s.labels)
        by_labels = defaultdict(list)
        for s in m.samples:
            by_labels[tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))].append(s)
        for series in by_labels.values():
            buckets = [s for s in series if s.name.endswith("_bucket")]
            assert [s.labels["le"] for s in buckets] == [str(b) for b in spec.buckets] + ["+Inf"]
            assert all(a.value <= b.value for a, b in zip(buckets, buckets[1:]))
            (count,) = [s.value for s in series if s.name.endswith("_count")]
            assert buckets[-1].value == count


@pytest.mark.parametrize("mode", RANK_HISTOGRAM_MODES)
def test_text_renders_as_the_library_and_parses(one_run_dir, mode):
    families = collect(one_run_dir, mode)
    renderer = Renderer()
    for encoder in (generate_latest, openmetrics_latest):
        for _ in range(2):   # the second rendering from the cached prefixes
            assert renderer.render(Frozen(families), encoder) == encoder(Frozen(families))
    text = renderer.render(Frozen(families)).decode()
    om = renderer.render(Frozen(families), openmetrics_latest).decode()
    parsed = [s for f in parse_text(text) for s in f.samples]
    parsed_om = [s for f in parse_openmetrics(om) for s in f.samples]   # refuses a histogram without +Inf
    assert len(parsed) == len(parsed_om) == sum(len(m.samples) for m in families)


def test_the_library_merge_is_reduced_the_same(one_run_dir):
    """Where the reader falls back to MultiProcessCollector.merge (plain Metrics, not merged slots),
    a reduced mode serves the same samples and text."""
    from prometheus_client.multiprocess import MultiProcessCollector

    from rankscope.exporter.reader import FENCE_NAMES, Reader

    run_dir = one_run_dir / run_slug("job-a")
    files = sorted(str(f) for f in run_dir.glob("*.db"))
    for mode in ("sum-count", "node-buckets"):
        ours = reduce_histograms(Reader().merge(run_dir, files), mode)
        # the library serves every family of the files; the exporter never the publisher's fences
        merged = [m for m in MultiProcessCollector.merge(files, accumulate=True) if m.name not in FENCE_NAMES]
        theirs = reduce_histograms(merged, mode)
        assert canon(ours, skip=()) == canon(theirs, skip=())
        assert Renderer().render(Frozen(ours)) == Renderer().render(Frozen(theirs)) == generate_latest(Frozen(theirs))


def series_per_rank_and_node(families) -> tuple[dict[str, int], int]:
    """Series per rank of run job-a, and the series without a rank label."""
    per_rank: dict[str, int] = defaultdict(int)
    other = 0
    for m in families:
        for s in m.samples:
            if s.labels.get("run") == "job-a" and "rank" in s.labels:
                per_rank[s.labels["rank"]] += 1
            elif s.labels.get("run") == "job-a":
                other += 1
    return dict(per_rank), other


def test_series_saved_per_rank(metrics_dir):
    """What each mode saves is each rank's bucket series; node-buckets adds one histogram per node."""
    counts = {mode: series_per_rank_and_node(collect(metrics_dir, mode)) for mode in RANK_HISTOGRAM_MODES}
    full, _ = counts["full"]
    buckets = sum(1 for m in collect(metrics_dir, "full") for s in m.samples
                  if s.name.endswith("_bucket") and s.labels.get("rank") == "0" and s.labels["run"] == "job-a")
    # step 18, data wait 14, collectives 2 ops x 16, process groups 2 x 16
    assert buckets == 18 + 14 + 2 * 16 + 2 * 16
    for mode in ("sum-count", "node-buckets"):
        per_rank, _ = counts[mode]
        assert per_rank == {r: n - buckets for r, n in full.items()}
    assert counts["full"][1] == counts["sum-count"][1] == 0
    assert counts["node-buckets"][1] == buckets + 2 * 6   # each node histogram: the buckets, _sum and _count


def test_the_counting_tool(one_run_dir, capsys):
    """python -m rankscope.exporter.sizing: what docs/scaling.md's budget was measured with."""
    from rankscope.exporter.sizing import count_series, main

    full, reduced = count_series(one_run_dir, "full"), count_series(one_run_dir, "node-buckets")
    assert full[""] == {"per_rank": {}, "node": 13}   # info, the health of the ranks and evidence collectors (2 each), 8 state counts
    buckets = 18 + 14 + 2 * 16 + 2 * 16
    assert set(full["job-a"]["per_rank"]) == {"0", "1", "2", "3"}
    assert {r: n - buckets for r, n in full["job-a"]["per_rank"].items()} == reduced["job-a"]["per_rank"]
    assert (full["job-a"]["node"], reduced["job-a"]["node"]) == (0, buckets + 2 * 6)
    assert main(["--dir", str(one_run_dir)]) == 0
    per_rank = full["job-a"]["per_rank"]["0"]
    assert f"| job-a | sum-count | 4 | {per_rank - buckets} | 0 | 13 | {8 * (per_rank - buckets) + 13} |" \
        in capsys.readouterr().out


# -- scrape-time relabelling, from docs/scaling.md ----------------------------------------------------------------


def relabel_examples() -> list[dict]:
    """The metric_relabel_configs examples of docs/scaling.md's "Cardinality controls" (one YAML block each)."""
    section = SCALING.read_text().split("## Cardinality controls", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```yaml\n(.*?)```", section, re.S)
    examples = [yaml.safe_load(b)["metric_relabel_configs"] for b in blocks if "metric_relabel_configs" in b]
    assert len(examples) >= 3
    return examples


def relabel(samples_: list, rules: list[dict]) -> list:
    """Prometheus's keep/drop on joined source labels (anchored RE2; these regexes are Python-compatible)."""
    kept = list(samples_)
    for rule in rules:
        assert rule["action"] in ("drop", "keep")
        pattern = re.compile(f"^(?:{rule['regex']})$")
        sep = rule.get("separator", ";")

        def value(s):
            return sep.join(s.name if label == "__name__" else s.labels.get(label, "")
                            for label in rule["source_labels"])

        kept = [s for s in kept if bool(pattern.match(value(s))) == (rule["action"] == "keep")]
    return kept


def test_relabel_examples_drop_what_the_doc_says(metrics_dir):
    full = [s for m in collect(metrics_dir, "full") for s in m.samples]
    per_rank_buckets = [s for s in full if s.name.endswith("_bucket") and "rank" in s.labels]
    all_buckets, collectives_only, local_rank_0 = relabel_examples()[:3]
    # 1: every per-rank bucket, nothing else: sum-count mode at scrape time.
    kept = relabel(full, all_buckets)
    assert len(kept) == len(full) - len(per_rank_buckets) and not [s for s in kept if s.name.endswith("_bucket")]
    sum_count = [s for m in collect(metrics_dir, "sum-count") for s in m.samples]
    key = lambda s: (s.name, tuple(sorted(s.labels.items())))   # noqa: E731
    assert {key(s) for s in kept} == {key(s) for s in sum_count}
    # 2: the collective and process-group buckets only; step time and data wait keep theirs.
    kept = relabel(full, collectives_only)
    assert {family_of(s.name) for s in full if s not in kept} == {
        "rankscope_collective_duration_seconds", "rankscope_process_group_collective_duration_seconds"}
    assert all(s.name.endswith("_bucket") for s in full if s not in kept)
    # 3: buckets of local rank 0 only, one rank per node.
    kept = relabel(full, local_rank_0)
    assert {s.labels["local_rank"] for s in kept if s.name.endswith("_bucket")} == {"0"}
    assert len(full) - len(kept) == len([s for s in per_rank_buckets if s.labels["local_rank"] != "0"])


# -- real processes: rank processes, an exporter per mode, Prometheus ----------------------------------------------

RANK_PROCESS = r"""
import sys, time
from pathlib import Path
from tests.unit.exporter.test_cardinality import write_rank
write_rank(Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
print("ready", flush=True)
time.sleep(600)
"""
LIVE_RANKS = 4
# Ranks that wrote and then wait: no state may change between the exporters' scrapes.
# Exporters that compare their pages value for value: no state may change between their
# scrapes, and no node counter (the network collector's TCP segments move all the time).
PATIENT = ["--stuck-after", "600", "--frozen-after", "600", "--suspect-after", "600", "--compact-after", "600",
           "--no-network"]
OPENMETRICS = "application/openmetrics-text;version=1.0.0"


@pytest.fixture(scope="module")
def live_node(tmp_path_factory):
    """LIVE_RANKS rank processes of one run, done writing and alive, and an exporter in each mode:
    full by default, sum-count by its variable, node-buckets by its flag."""
    from tests.helpers.exporter_proc import ExporterProcess, _env, kill

    metrics_dir = tmp_path_factory.mktemp("live")
    procs = []
    try:
        for rank in range(LIVE_RANKS):
            procs.append(subprocess.Popen(
                [sys.executable, "-c", RANK_PROCESS, str(metrics_dir), "live-job", "node-live", str(rank),
                 str(LIVE_RANKS)], cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True))
        for p in procs:
            line = p.stdout.readline()
            assert line.strip() == b"ready", line + p.stdout.read1(4000)
        exporters = {"full": ExporterProcess(metrics_dir, PATIENT),
                     "sum-count": ExporterProcess(metrics_dir, PATIENT, env={"RANKSCOPE_RANK_HISTOGRAMS": "sum-count"}),
                     "node-buckets": ExporterProcess(metrics_dir, PATIENT + ["--rank-histograms", "node-buckets"])}
        try:
            for e in exporters.values():
                e.start()
            yield exporters
        finally:
            for e in exporters.values():
                e.__exit__(None, None, None)
    finally:
        for p in procs:
            kill(p)
            p.stdout.close()


def scrape(url: str, accept: str = "") -> str:
    import urllib.request

    with urllib.request.urlopen(urllib.request.Request(url, headers={"Accept": accept}), timeout=10) as resp:
        return resp.read().decode()


def page(url: str, accept: str = "") -> dict[tuple, str]:
    """(sample name, sorted labels) -> value repr, without the series derived from the scrape's time."""
    text = scrape(url, accept)
    parse = parse_openmetrics if accept else parse_text
    return {(s.name, tuple(sorted(s.labels.items()))): repr(s.value) for f in parse(text) for s in f.samples
            if family_of(s.name) not in TIME_DERIVED}


