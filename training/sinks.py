"""Step-indexed run summaries for TensorBoard and MLflow: one run, written by rank 0 only.

Prometheus keeps series by time; a person comparing two training runs wants
them by step, and one run per job, not one per GPU (one MLflow run per rank,
every node logging to the tracking server, TensorBoard with hundreds of runs
and ``add_scalars``' writer per tag are the known ways to hurt these tools).
So the sink runs on the global rank 0 only, reads every rank's values from the
node exporters' ``/metrics`` (no collective on the training path, no socket on
the hot path), and writes one record of job-wide figures per interval, at the
highest training step any rank has reached (docs/sinks.md):

    rankscope/step_time/{min,median,max}   mean step seconds of each rank over the interval, across ranks
    rankscope/slowest_rank                 the rank whose step time goes most to compute (forward+backward+optimizer)
    rankscope/straggler_ratio              its compute share over the median of its peers'
    rankscope/comm_wait_fraction[/max]     comm_wait phase seconds / step (phase) seconds (all ranks pooled; worst rank)
    rankscope/loss/{mean,spread,std}       across the ranks' last finite loss
    rankscope/throughput/steps_per_s       steps per second, mean over ranks
    rankscope/mfu, rankscope/goodput       only when the ranks publish the series they come from
    rankscope/ranks/{reporting,stalled,dead}
    rankscope/events/{nonfinite,oom,restarts,hang_suspects}
    text (TensorBoard add_text / MLflow tag rankscope.last_event): one line per event

Threads (all daemons of the rank 0 process, none on the training path):
``rankscope-sink`` scrapes and summarises every ``interval_s``; each backend has
its writer thread (``rankscope-sink-tensorboard``, ``rankscope-sink-mlflow``)
behind a bounded queue. A record that does not fit, or that its backend fails
to write (a dead MLflow server, a full disk), is dropped and counted in
``rankscope_telemetry_dropped_total{what="sink"}``.

This module imports neither tensorboard nor mlflow until a writer thread opens
its backend; ``build`` checks at start-up that what is configured can work.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import queue
import statistics
import tempfile
import threading
import time
import urllib.error
import urllib.parse
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from rankscope import pages
from rankscope.contract.environment import ConfigError, metrics_url
from rankscope.contract.thresholds import STRAGGLER_PHASES as COMPUTE_PHASES
from rankscope.exporter.catalog import STALLED_STATES

log = logging.getLogger("rankscope")

TAG = "rankscope/"
EVENTS_TEXT_TAG = "rankscope/events"
MLFLOW_EVENT_TAG = "rankscope.last_event"
MLFLOW_RUN_TAG = "rankscope.run"
# Schemes MLflow's tracking client accepts for a tracking store.
MLFLOW_SCHEMES = ("http", "https", "sqlite", "postgresql", "mysql", "mssql", "databricks", "file")
SQL_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
# The sink's own HTTP settings for MLflow (rank 0 only; a value the user set wins): fail within seconds,
# not after MLflow's default 7 retries with exponential back-off over minutes.
MLFLOW_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "5", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1"}
# How far a backend may fall behind before records are dropped (and counted): two minutes of records,
# at least 8. MLflow's import and a new sqlite store's schema take ~2.5 s of CPU on the writer thread,
# over 8 s on a node whose cores the ranks keep busy: at a 1 s interval, 8 records were too few.
QUEUE_SECONDS = 120.0
QUEUE_MIN_RECORDS = 8
MLFLOW_PENDING = 4         # asynchronous MLflow batches in flight; the writer waits for the oldest beyond
SCRAPE_TIMEOUT_S = 5.0
WANTED = frozenset({
    "rankscope_steps_total", "rankscope_step_duration_seconds_sum", "rankscope_step_duration_seconds_count",
    "rankscope_phase_seconds_total", "rankscope_loss", "rankscope_step", "rankscope_nonfinite_total",
    "rankscope_oom_total", "rankscope_rank_start_timestamp_seconds", "rankscope_rank_info", "rankscope_rank_state",
    "rankscope_hang_suspect", "rankscope_model_flops_total", "rankscope_device_peak_flops",
    "rankscope_wall_seconds_total", "rankscope_last_step_timestamp_seconds",
})


# -- configuration checks (MonitorConfig and start-up) ---------------------------------------
def exporter_urls(text: str | None) -> list[str]:
    """``host:port,host:port`` (or ``http(s)://host:port[/metrics]``) as metrics URLs; ConfigError if malformed."""
    urls = []
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        parts = urllib.parse.urlsplit(item if "://" in item else "http://" + item)
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
            raise ConfigError(f"{item!r} is not host:port or an http(s)://host:port URL", field="sink_exporters")
        path = parts.path if parts.path not in ("", "/") else "/metrics"
        urls.append(urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, parts.query, "")))
    return urls


def check_mlflow_uri(uri: str) -> str:
    """The URI's scheme; ConfigError unless MLflow's tracking client takes it."""
    scheme = urllib.parse.urlsplit(uri).scheme.split("+")[0].lower()
    if scheme not in MLFLOW_SCHEMES:
        raise ConfigError(f"{uri!r}: the scheme must be one of {', '.join(s + ':' for s in MLFLOW_SCHEMES)} "
                          "(e.g. http://mlflow:5000 or sqlite:////path/mlflow.db)", field="mlflow_tracking_uri")
    if scheme in ("http", "https") and not urllib.parse.urlsplit(uri).hostname:
        raise ConfigError(f"{uri!r}: no host", field="mlflow_tracking_uri")
    return scheme


def build(config: Any, identity: Any, errors: Any) -> "Sink | None":
    """The sink this rank runs, or None (not rank 0, or nothing configured). Checks now, at
    start-up, everything that would otherwise fail later: the optional packages, a directory
    that cannot be written, a database whose directory does not exist. Starts nothing."""
    if config.tensorboard_dir is None and config.mlflow_tracking_uri is None:
        return None
    if identity.rank != 0:
        return None
    urls = []
    if config.exporter != "off":
        urls.append(metrics_url(config.metrics_addr, config.metrics_port))   # the node's own: first
    urls += [u for u in exporter_urls(config.sink_exporters) if u not in urls]
    if not urls:
        raise ConfigError("the TensorBoard / MLflow sink reads the node exporters' /metrics, and exporter=off "
                          "starts none: set RANKSCOPE_SINK_EXPORTERS=host:port[,host:port...]")
    writers: list[Backend] = []
    if config.tensorboard_dir is not None:
        writers.append(TensorBoardBackend(_check_tensorboard(Path(config.tensorboard_dir)), identity.run))
    if config.mlflow_tracking_uri is not None:
        _check_mlflow(config.mlflow_tracking_uri)
        writers.append(MlflowBackend(config.mlflow_tracking_uri, config.mlflow_experiment, identity.run))
    return Sink(urls, identity.run, config.sink_interval_s, writers, errors.drop)


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


def _check_tensorboard(directory: Path) -> Path:
    if _missing("tensorboard"):
        raise ConfigError("tensorboard_dir is set but the tensorboard package is not installed: "
                          "pip install 'rankscope[tensorboard]'")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".rankscope-probe-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{directory} cannot be written: {e.strerror or e}", field="tensorboard_dir") from None
    return directory


def _check_mlflow(uri: str) -> None:
    scheme = check_mlflow_uri(uri)
    if _missing("mlflow"):
        raise ConfigError("mlflow_tracking_uri is set but MLflow is not installed: pip install 'rankscope[mlflow]'")
    if scheme in SQL_SCHEMES and _missing("sqlalchemy"):
        raise ConfigError(f"{uri!r}: a {scheme} store needs the full MLflow package (SQLAlchemy), not "
                          "mlflow-skinny: pip install mlflow, or use the tracking server's http(s):// URI",
                          field="mlflow_tracking_uri")
    if scheme == "sqlite":
        path = uri.split(":///", 1)[1] if ":///" in uri else ""
        parent = Path(path).parent if path and path != ":memory:" else None
        if parent is not None and not (parent.is_dir() and os.access(parent, os.W_OK)):
            raise ConfigError(f"{uri!r}: the directory {parent} does not exist or cannot be written",
                              field="mlflow_tracking_uri")
    if scheme == "file" and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("1", "true"):
        raise ConfigError(f"{uri!r}: MLflow 3 refuses its file store unless MLFLOW_ALLOW_FILE_STORE=true; "
                          "use sqlite:////path/mlflow.db or a tracking server", field="mlflow_tracking_uri")


# -- reading the exporters -------------------------------------------------------------------
@dataclass
class RankValues:
    """One rank's series from one scrape (absent series stay None / empty)."""

    steps: float | None = None
    dur_sum: float | None = None
    dur_count: float | None = None
    phases: dict[str, float] = field(default_factory=dict)
    loss: float | None = None
    step: float | None = None
    step_ts: float | None = None
    nonfinite: float = 0.0
    oom: float = 0.0
    start_ts: float | None = None
    pids: frozenset[str] = frozenset()
    state: str | None = None
    hang_suspect: bool = False
    flops: float | None = None
    peak_flops: float | None = None
    wall: dict[str, float] = field(default_factory=dict)


def parse_page(text: str, run: str) -> dict[int, RankValues]:
    """Every rank of ``run`` in an exporter page (only the lines of the series used here are parsed)."""
    ranks: dict[int, RankValues] = {}
    pids: dict[int, set[str]] = {}
    for s in pages.parse(text, WANTED, run):
        labels = s.labels
        try:
            rank = int(labels["rank"])
        except (KeyError, ValueError):
            continue
        r = ranks.setdefault(rank, RankValues())
        name, v = s.name, float(s.value)
        if name == "rankscope_steps_total":
            r.steps = v
        elif name == "rankscope_step_duration_seconds_sum":
            r.dur_sum = v
        elif name == "rankscope_step_duration_seconds_count":
            r.dur_count = v
        elif name == "rankscope_phase_seconds_total":
            r.phases[labels.get("phase", "")] = r.phases.get(labels.get("phase", ""), 0.0) + v
        elif name == "rankscope_loss":
            r.loss = v
        elif name == "rankscope_step":
            r.step = v if r.step is None or not math.isfinite(r.step) else max(r.step, v)
        elif name == "rankscope_last_step_timestamp_seconds":
            r.step_ts = v
        elif name == "rankscope_nonfinite_total":
            r.nonfinite += v
        elif name == "rankscope_oom_total":
            r.oom += v
        elif name == "rankscope_rank_start_timestamp_seconds":
            r.start_ts = v
        elif name == "rankscope_rank_info":
            pids.setdefault(rank, set()).add(labels.get("process_id", ""))
        elif name == "rankscope_rank_state":
            if v == 1:
                r.state = labels.get("state")
        elif name == "rankscope_hang_suspect":
            r.hang_suspect = r.hang_suspect or v == 1
        elif name == "rankscope_model_flops_total":
            r.flops = v
        elif name == "rankscope_device_peak_flops":
            r.peak_flops = v
        elif name == "rankscope_wall_seconds_total":
            r.wall[labels.get("category", "")] = r.wall.get(labels.get("category", ""), 0.0) + v
    for rank, found in pids.items():
        ranks[rank].pids = frozenset(found)
    return ranks


# -- summarising -----------------------------------------------------------------------------
@dataclass
class Record:
    """One interval's figures: scalars by tag, and event lines, at ``step``."""

    step: int
    scalars: dict[str, float]
    events: list[str]
    wall_time: float


def _delta(now: float | None, before: float | None) -> float | None:
    """A counter's increase; a counter lower than before was reset (a new process): all of it is new."""
    if now is None or before is None:
        return None
    return now - before if now >= before else now


def _finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v)


class Summarizer:
    """Turns successive scrapes into records. Pure: no I/O, no threads (tested on its own)."""

    def __init__(self) -> None:
        self.prev: dict[int, RankValues] | None = None
        self.last_step: int | None = None
        self.last_states: dict[str, float] = {}

    def update(self, ranks: Mapping[int, RankValues]) -> Record | None:
        """The record of the interval since the previous call; None for the first call, and for an
        interval with nothing new (no step, no event)."""
        prev = self.prev
        self.prev = dict(ranks)
        if prev is None or not ranks:
            return None
        steps = [r.step for r in ranks.values() if _finite(r.step)]
        step = int(max(steps)) if steps else 0
        scalars: dict[str, float] = {}
        events: list[str] = []
        step_means: dict[int, float] = {}
        compute: dict[int, float] = {}
        comm_fraction: dict[int, float] = {}
        comm_total = step_total = 0.0
        rates: list[float] = []
        mfu: list[float] = []
        productive = wall = 0.0
        has_wall = False
        nonfinite = oom = restarts = 0
        for rank in sorted(ranks):
            r, p = ranks[rank], prev.get(rank)
            if p is None:
                continue
            if (p.start_ts is not None and r.start_ts is not None and r.start_ts != p.start_ts) or \
                    (p.pids and r.pids - p.pids):
                restarts += 1
                events.append(f"rank {rank} restarted" + (f" (process {', '.join(sorted(r.pids - p.pids))})"
                                                           if r.pids - p.pids else ""))
            d_nonfinite = _delta(r.nonfinite, p.nonfinite) or 0.0
            d_oom = _delta(r.oom, p.oom) or 0.0
            if d_nonfinite:
                nonfinite += int(d_nonfinite)
                events.append(f"rank {rank}: {int(d_nonfinite)} step(s) with a non-finite loss or gradient norm")
            if d_oom:
                oom += int(d_oom)
                events.append(f"rank {rank}: {int(d_oom)} out-of-memory error(s)")
            d_steps = _delta(r.steps, p.steps)
            d_sum, d_count = _delta(r.dur_sum, p.dur_sum), _delta(r.dur_count, p.dur_count)
            if d_sum is not None and d_count:
                step_means[rank] = d_sum / d_count
            # Shares of the rank's phase seconds, which add up to its step time: a numerator and a
            # denominator from one counter family, so they cover the same steps even when a scrape
            # falls between the publisher's writes of the step counter and of the phases.
            d_phases = [d for d in (_delta(v, p.phases.get(ph)) for ph, v in r.phases.items()) if d is not None]
            phase_total = sum(d_phases)
            if phase_total > 0:
                d_comm = _delta(r.phases.get("comm_wait"), p.phases.get("comm_wait")) or 0.0
                comm_total += d_comm
                step_total += phase_total
                comm_fraction[rank] = d_comm / phase_total
                d_compute = [_delta(r.phases.get(ph), p.phases.get(ph)) for ph in COMPUTE_PHASES]
                if all(d is not None for d in d_compute):
                    compute[rank] = sum(d_compute) / phase_total   # type: ignore[arg-type]
            # Rates over the rank's own clock (its last steps' completion times), not over the scrapes'
            # (the values reach the exporter up to a publish interval late).
            span = r.step_ts - p.step_ts if _finite(r.step_ts) and _finite(p.step_ts) else 0.0
            if d_steps and span > 0:
                rates.append(d_steps / span)
            d_flops = _delta(r.flops, p.flops)
            if d_flops is not None and _finite(r.peak_flops) and r.peak_flops > 0 and span > 0:
                mfu.append(d_flops / span / r.peak_flops)
            if r.wall and p.wall:
                d_wall = sum(_delta(v, p.wall.get(c, 0.0)) or 0.0 for c, v in r.wall.items())
                if d_wall > 0:
                    has_wall = True
                    wall += d_wall
                    productive += _delta(r.wall.get("productive", 0.0), p.wall.get("productive", 0.0)) or 0.0
        if step_means:
            values = list(step_means.values())
            scalars[TAG + "step_time/min"] = min(values)
            scalars[TAG + "step_time/median"] = statistics.median(values)
            scalars[TAG + "step_time/max"] = max(values)
        if compute:
            slowest = max(sorted(compute), key=lambda k: compute[k])
            scalars[TAG + "slowest_rank"] = float(slowest)
            peers = [v for k, v in compute.items() if k != slowest]
            if peers and statistics.median(peers) > 0:
                scalars[TAG + "straggler_ratio"] = compute[slowest] / statistics.median(peers)
        if step_total > 0:
            scalars[TAG + "comm_wait_fraction"] = comm_total / step_total
            scalars[TAG + "comm_wait_fraction/max"] = max(comm_fraction.values())
        losses = [r.loss for r in ranks.values() if _finite(r.loss)]
        if losses:
            scalars[TAG + "loss/mean"] = statistics.fmean(losses)
            scalars[TAG + "loss/spread"] = max(losses) - min(losses)
            scalars[TAG + "loss/std"] = statistics.pstdev(losses)
        if rates:
            scalars[TAG + "throughput/steps_per_s"] = statistics.fmean(rates)
        if mfu:
            scalars[TAG + "mfu"] = statistics.fmean(mfu)
        if has_wall:
            scalars[TAG + "goodput"] = productive / wall
        # Rank states: counted every record; each rank that turns stalled, dead or suspect is an event.
        stalled = [k for k, r in ranks.items() if r.state in STALLED_STATES]
        dead = [k for k, r in ranks.items() if r.state == "dead"]
        suspects = [k for k, r in ranks.items() if r.hang_suspect]
        for k in sorted(ranks):
            p = prev.get(k)
            if ranks[k].state in STALLED_STATES + ("dead",) and (p is None or p.state != ranks[k].state):
                events.append(f"rank {k} is {ranks[k].state}")
            if ranks[k].hang_suspect and (p is None or not p.hang_suspect):
                events.append(f"rank {k} is the hang suspect (outside the collective its peers wait in)")
        states = {TAG + "ranks/reporting": float(len(ranks)), TAG + "ranks/stalled": float(len(stalled)),
                  TAG + "ranks/dead": float(len(dead)), TAG + "events/hang_suspects": float(len(suspects))}
        scalars.update(states)
        scalars[TAG + "events/nonfinite"] = float(nonfinite)
        scalars[TAG + "events/oom"] = float(oom)
        scalars[TAG + "events/restarts"] = float(restarts)
        # One record per step reached: an interval without progress is written only when something
        # happened (an event, a rank changing state), so a hung job does not repeat its last step.
        if step == self.last_step and not events and states == self.last_states:
            return None
        self.last_step, self.last_states = step, states
        return Record(step, scalars, [f"step {step}: {e}" for e in events], time.time())


# -- writing ---------------------------------------------------------------------------------
class Backend:
    name = "backend"
    reopen_after_error = False

    def open(self) -> None:
        raise NotImplementedError

    def write(self, record: Record) -> None:
        raise NotImplementedError

    def close(self) -> int:
        """Finish; returns the records found lost on the way (counted as drops)."""
        return 0

    def reset(self) -> None:
        """After a failed write: let the next record open the backend afresh."""


class TensorBoardBackend(Backend):
    """One event-file directory, ``<tensorboard_dir>/<run slug>``; ``add_scalar`` per tag."""

    name = "tensorboard"
    reopen_after_error = True

    def __init__(self, directory: Path, run: str):
        from rankscope.contract.rundir import run_slug

        self.log_dir = directory / run_slug(run)
        self.writer: Any = None

    def open(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # flush_secs: the interval's flush() below writes each record; max_queue bounds the writer's own queue.
        self.writer = SummaryWriter(log_dir=str(self.log_dir), max_queue=64, flush_secs=30)

    def write(self, record: Record) -> None:
        for tag, v in record.scalars.items():
            self.writer.add_scalar(tag, v, global_step=record.step, walltime=record.wall_time)
        if record.events:
            self.writer.add_text(EVENTS_TEXT_TAG, "  \n".join(record.events), global_step=record.step,
                                 walltime=record.wall_time)
        self.writer.flush()

    def close(self) -> int:
        if self.writer is not None:
            self.writer.close()
        return 0

    def reset(self) -> None:
        # TensorBoard's own writer thread dies on a write error (a full disk) and refuses every
        # later event: drop it, and let the next record start a new event file in the same run.
        writer, self.writer = self.writer, None
        try:
            if writer is not None:
                writer.close()
        except Exception:   # noqa: BLE001 - the same full disk
            pass


def _done(ops: Any) -> bool:
    """Whether MLflow's RunOperations has finished (False where its futures cannot be seen)."""
    futures = getattr(ops, "_operation_futures", None)
    return futures is not None and all(f.done() for f in futures)


class _OwnRunFilter(logging.Filter):
    """Keeps MLflow's async-logging error for each failed batch of the sink's run out of the log
    (each is counted as a drop, whose first reason is logged once); other runs' errors pass."""

    def __init__(self, run_id: str):
        super().__init__()
        self.run_id = run_id

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return self.run_id not in record.getMessage()
        except Exception:   # noqa: BLE001
            return True


class MlflowBackend(Backend):
    """One MLflow run per job (found again by its ``rankscope.run`` tag after a restart), through
    an ``MlflowClient`` with an explicit run id: a run the user has active in this process is untouched."""

    name = "mlflow"

    def __init__(self, uri: str, experiment: str, run: str):
        self.uri, self.experiment, self.run = uri, experiment, run
        self.client: Any = None
        self.run_id: str | None = None
        self.pending: deque[Any] = deque()
        self.failed = 0
        self._filter: _OwnRunFilter | None = None

    def open(self) -> None:
        if urllib.parse.urlsplit(self.uri).scheme.lower() in ("http", "https"):
            for k, v in MLFLOW_HTTP_DEFAULTS.items():
                os.environ.setdefault(k, v)
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=self.uri)
        exp = client.get_experiment_by_name(self.experiment)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(self.experiment)
        quoted = self.run.replace("\\", "\\\\").replace('"', '\\"')
        # A relaunch of rank 0 (torchelastic restart, the job resubmitted after a crash) continues the
        # run its earlier launch left RUNNING; a run that ended (FINISHED) is never reopened.
        found = client.search_runs([exp_id], f'tags.`{MLFLOW_RUN_TAG}` = "{quoted}" and attributes.status = "RUNNING"',
                                   max_results=1)
        if found:
            run_id = found[0].info.run_id
        else:
            run_id = client.create_run(exp_id, run_name=self.run, tags={MLFLOW_RUN_TAG: self.run}).info.run_id
        self.client, self.run_id = client, run_id
        self._filter = _OwnRunFilter(run_id)
        logging.getLogger("mlflow.utils.async_logging.async_logging_queue").addFilter(self._filter)

    def write(self, record: Record) -> None:
        from mlflow.entities import Metric, RunTag

        ts = int(record.wall_time * 1000)
        metrics = [Metric(k, float(v), ts, record.step) for k, v in record.scalars.items()]
        tags = [RunTag(MLFLOW_EVENT_TAG, "\n".join(record.events)[-5000:])] if record.events else []
        self.pending.append(self.client.log_batch(self.run_id, metrics, tags=tags, synchronous=False))
        while self.pending and (len(self.pending) > MLFLOW_PENDING or _done(self.pending[0])):
            self._settle(self.pending.popleft())   # bounded: MLflow's own queue has no limit

    def _settle(self, ops: Any) -> None:
        try:
            ops.wait()
        except Exception:   # noqa: BLE001 - MLflow raises its own and requests' exceptions
            self.failed += 1

    def take_failed(self) -> int:
        n, self.failed = self.failed, 0
        return n

    def close(self) -> int:
        while self.pending:
            self._settle(self.pending.popleft())
        if self.client is not None and self.run_id is not None:
            try:
                self.client.set_terminated(self.run_id, "FINISHED")
            except Exception:   # noqa: BLE001 - the server is gone: the run stays RUNNING there
                pass
        if self._filter is not None:
            logging.getLogger("mlflow.utils.async_logging.async_logging_queue").removeFilter(self._filter)
        return self.take_failed()


class _Writer:
    """One backend's thread and bounded queue."""

    def __init__(self, backend: Backend, drop: Callable[..., None], records: int = QUEUE_MIN_RECORDS):
        self.backend = backend
        self.drop = drop
        self.queue: queue.Queue[Record] = queue.Queue(maxsize=records)
        self.closing = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"rankscope-sink-{backend.name}", daemon=True)
        self.opened = False

    def offer(self, record: Record) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.drop("sink", f"the {self.backend.name} writer is {self.queue.maxsize} records behind")

    def _run(self) -> None:
        while True:
            try:
                record = self.queue.get(timeout=0.2)
            except queue.Empty:
                if self.closing.is_set():
                    break
                continue
            try:
                if not self.opened:
                    self.backend.open()
                    self.opened = True
                self.backend.write(record)
            except Exception as e:   # noqa: BLE001 - a dead server, a full disk: the record is lost
                self.drop("sink", f"{self.backend.name}: {type(e).__name__}: {str(e)[:200]}")
                if self.opened and self.backend.reopen_after_error:
                    self.backend.reset()
                    self.opened = False
            failed = getattr(self.backend, "take_failed", lambda: 0)()
            if failed:
                self.drop("sink", f"{self.backend.name}: an asynchronous batch failed", n=failed)
        try:
            lost = self.backend.close() if self.opened else 0
        except Exception as e:   # noqa: BLE001
            lost = 0
            self.drop("sink", f"{self.backend.name}: closing failed: {type(e).__name__}: {str(e)[:200]}")
        if lost:
            self.drop("sink", f"{self.backend.name}: an asynchronous batch failed", n=lost)


class Sink:
    """Scrapes ``urls`` every ``interval_s`` and hands each record to every backend's writer."""

    def __init__(self, urls: Iterable[str], run: str, interval_s: float, backends: Iterable[Backend],
                 drop: Callable[..., None]):
        self.urls = list(urls)
        self.run = run
        self.interval_s = interval_s
        self.drop = drop
        records = max(QUEUE_MIN_RECORDS, math.ceil(QUEUE_SECONDS / interval_s))
        self.writers = [_Writer(b, drop, records) for b in backends]
        self.summarizer = Summarizer()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rankscope-sink", daemon=True)
        self.records = 0

    @property
    def backends(self) -> list[Backend]:
        return [w.backend for w in self.writers]

    def local_exporter(self, url: str) -> None:
        """The node's own exporter answers at ``url``, found at start-up (another user's exporter
        may hold the configured port)."""
        self.urls[0] = url

    def start(self) -> None:
        for w in self.writers:
            w.thread.start()
        self._thread.start()

    def _run(self) -> None:
        self.collect()   # the baseline the first interval is measured from
        while not self._stop.wait(self.interval_s):
            self.collect()
        self.collect()   # the last interval, up to close()

    def collect(self) -> None:
        try:
            ranks: dict[int, RankValues] = {}
            answered = 0
            for url in self.urls:
                try:
                    text = pages.fetch(url, min(SCRAPE_TIMEOUT_S, max(self.interval_s, 1.0)))
                except (OSError, urllib.error.URLError, ValueError) as e:
                    log.debug("rankscope sink: %s: %s", url, e)
                    continue
                answered += 1
                for rank, values in parse_page(text, self.run).items():
                    ranks.setdefault(rank, values)   # a rank listed by two exporters: the first
            if not answered:
                self.drop("sink", f"no exporter answered ({', '.join(self.urls)})")
                return
            record = self.summarizer.update(ranks)
        except Exception as e:   # noqa: BLE001 - never let the thread die
            self.drop("sink", f"summary failed: {type(e).__name__}: {e}")
            return
        if record is None:
            return
        self.records += 1
        for w in self.writers:
            w.offer(record)

    def stop(self, timeout_s: float = 3.0) -> None:
        """One last record, then the writers finish; gives up (daemon threads) after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(max(0.0, deadline - time.monotonic()))
        for w in self.writers:
            w.closing.set()
        for w in self.writers:
            if w.thread.is_alive():
                w.thread.join(max(0.0, deadline - time.monotonic()))
            left = w.queue.qsize() if w.thread.is_alive() else 0
            if left:
                self.drop("sink", f"{w.backend.name}: still writing at close", n=left)
