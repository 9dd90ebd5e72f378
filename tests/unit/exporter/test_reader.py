"""The exporter's incremental reader (rankscope.exporter.reader) and renderer
(rankscope.exporter.exposition) give what prometheus_client gives on the same
files: MultiProcessCollector.merge sample for sample (values compared by repr,
so -0.0, NaN and the last bit of a float sum count), and byte-identical text
from generate_latest and the OpenMetrics encoder.

The files are real: written by prometheus_client's own multiprocess values
(with a chosen process identifier, as tests/scale/db_growth.py does) and by
rankscope.publishing.metrics.RankMetrics. Nothing here starts a process.
"""

from __future__ import annotations

import contextlib
import gzip
import math
import os
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary, values
from prometheus_client.exposition import generate_latest, make_wsgi_app
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.registry import Collector

from rankscope.contract.rundir import Registration, process_start_ticks
from rankscope.exporter.config import ExporterConfig
from rankscope.exporter.exposition import Renderer, make_metrics_app
from rankscope.exporter.ranks import RankCollector
from rankscope.exporter.reader import Reader

MODES = ("all", "liveall", "min", "livemin", "max", "livemax", "sum", "livesum", "mostrecent", "livemostrecent")
BUCKETS = (0.001, 0.01, 0.1, 1.0, 10.0)


@contextlib.contextmanager
def as_process(directory: Path, pid: str):
    """prometheus_client metrics created inside write to ``directory`` as process ``pid``."""
    saved_env, saved_class = os.environ.get("PROMETHEUS_MULTIPROC_DIR"), values.ValueClass
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
    values.ValueClass = values.MultiProcessValue(process_identifier=lambda: pid)
    try:
        yield
    finally:
        values.ValueClass = saved_class
        if saved_env is None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = saved_env


class Proc:
    """One simulated process's metrics: a counter, a histogram, a summary and a gauge per mode."""

    def __init__(self, directory: Path, pid: str):
        self.directory, self.pid = directory, pid
        with as_process(directory, pid):
            reg = CollectorRegistry()
            self.counter = Counter("t_ops", "ops done", ["run", "rank", "op"], registry=reg)
            self.hist = Histogram("t_seconds", "durations", ["run", "rank"], buckets=BUCKETS, registry=reg)
            self.summary = Summary("t_bytes", "sizes", ["run"], registry=reg)
            self.gauges = {m: Gauge(f"t_gauge_{m}", f"a {m} gauge", ["run", "rank"], multiprocess_mode=m, registry=reg)
                           for m in MODES}

    def child(self, metric, **labels):
        with as_process(self.directory, self.pid):
            return metric.labels(**labels)

    def write(self, rank: str, k: float, ops=("all_reduce", "broadcast")) -> None:
        for op in ops:
            self.child(self.counter, run="r", rank=rank, op=op).inc(0.1 * k)
            self.child(self.counter, run="r", rank="shared", op=op).inc(0.7 + k)   # summed across processes
        for d in (0.0005, 0.02, 0.3, 3.0, 30.0 * k):
            self.child(self.hist, run="r", rank=rank).observe(d)
            self.child(self.hist, run="r", rank="shared").observe(d / 3)
        self.child(self.summary, run="r").observe(k * 1.1)
        for i, (mode, g) in enumerate(self.gauges.items()):
            self.child(g, run="r", rank=rank).set(k + i / 10)
            self.child(g, run="r", rank="shared").set(k * (i + 1) - 7.3)


def files_of(directory: Path) -> list[str]:
    return sorted(str(p) for p in directory.glob("*.db"))


def canon(metrics) -> list:
    """Families and samples, values by repr (NaN equals NaN, -0.0 differs from 0.0), order kept."""
    return [(m.name, m.type, m.documentation, m.unit,
             [(s.name, s.labels, repr(s.value), s.timestamp, s.exemplar) for s in m.samples]) for m in metrics]


class Frozen(Collector):
    def __init__(self, metrics):
        self.metrics = list(metrics)

    def collect(self):
        return self.metrics


def assert_same(reader: Reader, directory: Path, paths: list[str] | None = None) -> list:
    paths = files_of(directory) if paths is None else paths
    ours = reader.merge(directory, paths)
    theirs = list(MultiProcessCollector.merge(paths, accumulate=True))
    assert canon(ours) == canon(theirs)
    renderer = Renderer()
    for encoder in (generate_latest, openmetrics_latest):
        assert renderer.render(Frozen(ours), encoder) == encoder(Frozen(theirs))
    return ours


def test_every_type_and_gauge_mode_merges_as_prometheus_client(tmp_path):
    procs = [Proc(tmp_path, pid) for pid in ("101", "102", "103")]
    for k, p in enumerate(procs):
        p.write(str(k), k + 1)
    reader = Reader()
    ours = assert_same(reader, tmp_path)
    names = {m.name for m in ours}
    assert {"t_ops", "t_seconds", "t_bytes"} <= names and all(f"t_gauge_{m}" in names for m in MODES)
    shared = [s for m in ours if m.name == "t_ops" for s in m.samples if s.labels["rank"] == "shared"]
    assert len(shared) == 2 and all(s.value > 3 * 0.7 for s in shared)   # summed over the three processes


def test_special_values_and_unset_mostrecent(tmp_path):
    p, q = Proc(tmp_path, "201"), Proc(tmp_path, "202")
    for proc, rank in ((p, "0"), (q, "1")):
        for mode, g in proc.gauges.items():
            proc.child(g, run="r", rank=rank).set(-0.0)
            proc.child(g, run="r", rank="nan").set(math.nan)
            proc.child(g, run="r", rank="inf").set(-math.inf if rank == "0" else math.inf)
            proc.child(g, run="r", rank="big").set(1.5e300)
            proc.child(g, run="r", rank="never-set")   # mostrecent: timestamp 0, never served
    p.child(p.counter, run="r", rank="0", op="x").inc(1e-300)
    p.child(p.hist, run="r", rank="0").observe(math.inf)
    ours = assert_same(Reader(), tmp_path)
    served = {(m.name, s.labels.get("rank")) for m in ours for s in m.samples}
    assert ("t_gauge_mostrecent", "never-set") not in served and ("t_gauge_sum", "never-set") in served


def test_exact_after_values_change_between_scrapes(tmp_path):
    procs = [Proc(tmp_path, pid) for pid in ("301", "302")]
    reader = Reader()
    for scrape in range(6):
        for k, p in enumerate(procs):
            p.write(str(k), scrape + 0.37 * k)
        assert_same(reader, tmp_path)
    assert_same(reader, tmp_path)   # nothing changed since: the snapshots are reused


def test_exact_after_new_series_grow_a_file(tmp_path):
    p = Proc(tmp_path, "401")
    p.write("0", 1)
    reader = Reader()
    assert_same(reader, tmp_path)
    size = os.path.getsize(tmp_path / "counter_401.db")
    for i in range(700):   # long label values: the file outgrows its first 64 KiB and is doubled
        p.child(p.counter, run="r", rank=f"{i}-{'x' * 80}", op="all_gather").inc(i)
        if i % 150 == 0:
            assert_same(reader, tmp_path)
    assert os.path.getsize(tmp_path / "counter_401.db") > size
    assert_same(reader, tmp_path)
    q = Proc(tmp_path, "402")   # a new process: new files
    q.write("1", 2)
    assert_same(reader, tmp_path)


def test_exact_when_a_file_is_replaced_or_removed(tmp_path):
    p = Proc(tmp_path, "501")
    p.write("0", 1)
    q = Proc(tmp_path, "502")
    q.write("1", 2)
    reader = Reader()
    assert_same(reader, tmp_path)
    # A new process with a recycled pid: the old files were removed, new ones written under the same names.
    for f in tmp_path.glob("*_501.db"):
        f.unlink()
    assert_same(reader, tmp_path)
    again = Proc(tmp_path, "501")
    again.write("7", 5, ops=("send",))
    assert_same(reader, tmp_path)
    # The same inode rewritten with other entries of the same sizes (rank 1's keys where rank 7's were).
    before = (tmp_path / "counter_501.db").stat().st_ino
    other = Proc(tmp_path / "elsewhere", "501") if (tmp_path / "elsewhere").mkdir() is None else None
    other.write("8", 9, ops=("recv",))
    with open(tmp_path / "counter_501.db", "r+b") as dst:
        dst.write((tmp_path / "elsewhere" / "counter_501.db").read_bytes())
    assert (tmp_path / "counter_501.db").stat().st_ino == before
    ours = assert_same(reader, tmp_path)
    assert any(s.labels.get("op") == "recv" for m in ours for s in m.samples)


def test_an_empty_new_file_is_no_entry(tmp_path):
    Proc(tmp_path, "601").write("0", 1)
    (tmp_path / "counter_602.db").write_bytes(b"")   # created, not yet sized by its process
    paths = files_of(tmp_path)
    ours = Reader().merge(tmp_path, paths)
    theirs = list(MultiProcessCollector.merge([p for p in paths if not p.endswith("_602.db")], accumulate=True))
    assert canon(ours) == canon(theirs)


# -- through the rank collector: registrations, dead processes, rank metrics ------------------

def _register(run_dir: Path, rank: int, pid: int, ticks) -> Registration:
    reg = Registration(run="r", rank=rank, local_rank=rank, node="n", world_size=2, local_world_size=2, pid=pid,
                       pid_start_ticks=ticks, agent_pid=1, agent_start_ticks=process_start_ticks(1),
                       started_at=time.time() + rank, info={"process_id": str(pid)})
    reg.save(run_dir)
    return reg


def _oracle(run_dir: Path, dead: set[int], latest_pids: set[str]) -> list:
    """What the exporter served before the reader: prometheus_client's merge of the files,
    without the live gauges of dead processes, rank_info of the newest process per rank only,
    and never the publisher's fences."""
    from rankscope.contract.rundir import db_file_pid
    from rankscope.exporter.reader import FENCE_NAMES

    files = [f for f in files_of(run_dir)
             if not (Path(f).name.startswith("gauge_live") and db_file_pid(Path(f)) in dead)]
    merged = [m for m in MultiProcessCollector.merge(files, accumulate=True) if m.name not in FENCE_NAMES]
    for m in merged:
        if m.name == "rankscope_rank_info":
            m.samples = [s for s in m.samples if s.labels.get("process_id") in latest_pids]
    return merged


def test_rank_collector_serves_the_merge_and_drops_dead_live_gauges(tmp_path):
    from rankscope.publishing.metrics import RankMetrics

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    me = os.getpid()
    ident = {"run": "r", "rank": "0", "local_rank": "0", "node": "n"}
    m = RankMetrics(run_dir, ident)   # this process: rank 0, alive
    from rankscope.contract.catalog import RANK_INFO_LABELS

    m.set_rank_info({**dict.fromkeys(RANK_INFO_LABELS, ""), "process_id": str(me)})
    m.steps.inc(3)
    m.step_duration.observe(0.2)
    m.heartbeat.set(time.time())
    m.step_ts.set(time.time())
    m.collective("all_reduce").duration.observe(0.001)
    reg = _register(run_dir, 0, me, process_start_ticks(me))
    gone = 2**22 + 4242   # above pid_max: a process that is gone
    old = Proc(run_dir, str(gone))   # rank 1's earlier process, gone: plain prometheus_client files
    old.write("1", 4)
    _register(run_dir, 1, gone, 12345)
    collector = RankCollector(ExporterConfig(directory=tmp_path, nvml=False))
    for step in range(3):
        m.steps.inc()
        m.heartbeat.set(time.time())
        expected = _oracle(run_dir, {gone}, {str(me), str(gone)})
        served = list(collector.collect())
        assert canon(served[:len(expected)]) == canon(expected)
        assert Renderer().render(Frozen(served)) == generate_latest(Frozen(served))
        assert Renderer().render(Frozen(served), openmetrics_latest) == openmetrics_latest(Frozen(served))
    assert any(s.name == "t_gauge_livemostrecent" for x in expected for s in x.samples) is False
    # Rank 0 "dies" (its registration no longer matches a live process): its live gauges go.
    reg.pid_start_ticks = -1
    reg.save(run_dir)
    expected = _oracle(run_dir, {gone, me}, {str(me), str(gone)})
    served = list(collector.collect())
    assert canon(served[:len(expected)]) == canon(expected)
    assert not any(x.name == "rankscope_heartbeat_timestamp_seconds" and x.samples for x in served)


def test_wsgi_app_bytes_equal_the_library_app(tmp_path):
    procs = [Proc(tmp_path, pid) for pid in ("701", "702")]
    for k, p in enumerate(procs):
        p.write(str(k), k + 1)
    paths = files_of(tmp_path)

    class Files(Collector):
        def collect(self):
            return MultiProcessCollector.merge(paths, accumulate=True)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Files())
    ours, theirs = make_metrics_app(registry), make_wsgi_app(registry)
    accepts = ["", "text/plain;version=0.0.4", "text/plain;version=1.0.0;escaping=allow-utf-8",
               "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
               "text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
               "application/openmetrics-text; version=1.0.0; escaping=underscores"]
    for accept in accepts:
        for encoding in ("", "gzip"):
            for query in ("", "name[]=t_ops_total"):
                environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/metrics", "QUERY_STRING": query,
                           "HTTP_ACCEPT": accept, "HTTP_ACCEPT_ENCODING": encoding}
                got = [], []
                a = b"".join(ours(dict(environ), lambda status, headers: got[0].extend([status, headers])))
                b = b"".join(theirs(dict(environ), lambda status, headers: got[1].extend([status, headers])))
                if encoding:
                    a, b = gzip.decompress(a), gzip.decompress(b)
                assert got[0] == got[1] and a == b, (accept, encoding, query)


def test_two_runs_in_one_directory_serve_each_family_once(tmp_path):
    """The ranks' families come once per run directory; a page must still hold each name once
    (OpenMetrics parsers reject a family whose samples are split: "Clashing name")."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
    from prometheus_client.parser import text_string_to_metric_families as parse_text

    from rankscope.publishing.metrics import RankMetrics

    me = os.getpid()
    for run in ("a", "b"):
        run_dir = tmp_path / run
        run_dir.mkdir()
        m = RankMetrics(run_dir, {"run": run, "rank": "0", "local_rank": "0", "node": "n"})
        m.steps.inc(3 if run == "a" else 5)
        m.step_duration.observe(0.2)
        Registration(run=run, rank=0, local_rank=0, node="n", world_size=1, local_world_size=1, pid=me,
                     pid_start_ticks=process_start_ticks(me), agent_pid=1, agent_start_ticks=process_start_ticks(1),
                     started_at=time.time()).save(run_dir)
    collector = RankCollector(ExporterConfig(directory=tmp_path, nvml=False))
    for encoder, parse in ((generate_latest, parse_text), (openmetrics_latest, parse_openmetrics)):
        text = Renderer().render(collector, encoder).decode()
        families = list(parse(text))
        names = [f.name for f in families]
        assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
        steps = {s.labels["run"]: s.value for f in families for s in f.samples if s.name == "rankscope_steps_total"}
        assert steps == {"a": 3.0, "b": 5.0}
