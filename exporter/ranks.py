"""The ranks of this node: their own metrics, and their state as seen from outside.

Each scrape merges the multiprocess files of every run in the directory
(``rankscope.exporter.reader``: prometheus_client's merge, replayed on keys
parsed once and values read incrementally), then derives what a rank cannot say about
itself: whether its process is alive, whether its interpreter still runs
(heartbeat), whether it is stuck, and whether it is the likely culprit of a
hang (outside any collective while its peers wait inside one).

A scrape only reads. Removing a run once its retention is over is the CLI's
janitor thread's job (``expired_run_dirs`` says which), so a scrape is never
slowed by, nor races with, a deletion.
"""

from __future__ import annotations

import glob
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from rankscope.exporter.catalog import BY_NAME as EXPORTER_SPECS
from rankscope.exporter.cardinality import reduce_histograms
from rankscope.exporter.config import ExporterConfig
from rankscope.exporter.evidence import EvidenceKeeper
from rankscope.exporter.reader import MergedFamily, Reader
from rankscope.contract.catalog import BLOCKS, COLLECTIVE_OPS, EAGER_COLLECTIVE_OPS, IDENTITY_LABELS
from rankscope.contract.states import ENDED_STATES, RANK_STATES
from rankscope.contract.rundir import (RANKS_SUBDIR, Registration, db_file_pid, latest_per_rank,
                                       load_registrations, process_state)


@dataclass
class RankView:
    """What the exporter knows about the newest process of one rank."""

    reg: Registration
    alive: bool
    heartbeat: float = 0.0
    last_step: float = 0.0
    in_flight: dict[str, float] = field(default_factory=dict)   # op -> started (unix)
    ops: list[str] = field(default_factory=lambda: list(EAGER_COLLECTIVE_OPS))   # ops the rank has used
    state: str = "starting"
    suspect: bool = False
    step_time: float = 0.0   # the longest of the rank's recent steps (RecentStepTimes)
    block_since: float = 0.0   # when it entered the checkpoint or evaluation block it is in (0: none)
    block_ended: float = 0.0   # when its last such block ended

    @property
    def progress_at(self) -> float:
        """Its last sign of progress: a step, or the end of a declared block (a 3-minute evaluation
        is progress, and the moment after it no stall), else its start."""
        return max(self.last_step, self.block_ended) or self.reg.started_at

    def stuck_after(self, cfg: ExporterConfig) -> float:
        """How long without a step is stuck for this rank: the configured floor, or a few of
        its own recent steps where those are longer (long steps are not hangs)."""
        return max(cfg.stuck_after_s, cfg.stuck_after_steps * self.step_time)


# A save that holds the GIL (a large pickle) stops the heartbeat for as long: inside a declared
# block, a heartbeat this late is still the save's, not a frozen interpreter (SIGSTOP still is).
BLOCK_FROZEN_AFTER_S = 300.0


def derive_states(views: list[RankView], cfg: ExporterConfig, now: float) -> None:
    """Fill in ``state`` and ``suspect`` for the ranks of one run on this node."""
    # A block's end is progress for its peers too: they waited for it (in a barrier after rank
    # 0's save), and their files say so for up to a publish interval after it ended.
    blocks_ended = max((v.block_ended for v in views), default=0.0)
    for v in views:
        stalled = now - max(v.progress_at, blocks_ended)
        frozen_after = max(cfg.frozen_after_s, BLOCK_FROZEN_AFTER_S) if v.block_since else cfg.frozen_after_s
        if v.reg.finished_at:
            v.state = "finished"
        elif not v.alive or v.reg.failed_at:   # gone, or on its way out on an exception
            v.state = "dead"
        elif process_state(v.reg.pid) == "T" or (v.heartbeat and now - v.heartbeat > frozen_after):
            v.state = "frozen"
        elif v.block_since:
            v.state = "busy"   # its own checkpoint or evaluation: no step is due
        elif v.last_step and stalled > v.stuck_after(cfg):
            v.state = "stuck_in_collective" if v.in_flight else "stuck"
        elif not v.last_step and v.in_flight and now - min(v.in_flight.values()) > cfg.stuck_after_s:
            # Before its first step, by how long it has waited in the collective, not since its
            # start: a first step of minutes passes through its backward's all-reduce (in flight
            # for a moment) long after the start, and is not stuck there.
            v.state = "stuck_in_collective"
        elif not v.last_step:
            # Before its first step the rank's pace is unknown (a first step of minutes, a
            # compilation): outside a collective it is starting, and stuck only as the suspect
            # its waiting peers make it (below). Inside one, it waits for a peer: stuck.
            v.state = "starting"
        else:
            v.state = "progressing"
    if any(v.state == "busy" for v in views):
        # Its peers wait for it (in a barrier after rank 0's save, which rankscope may not count
        # as a collective): not stuck, and nobody is a suspect. A block past the rules' bar
        # (block_stall_seconds) is paged there.
        for v in views:
            if v.state in ("stuck_in_collective", "stuck"):
                v.state = "progressing" if v.last_step else "starting"
        return
    waits = [now - min(v.in_flight.values()) for v in views if v.alive and v.in_flight]
    longest_wait = max(waits, default=0.0)
    if longest_wait <= cfg.suspect_after_s:
        return
    for v in views:
        stalled = now - max(v.progress_at, blocks_ended)
        if v.state in ENDED_STATES:
            continue
        outside = not v.in_flight or v.state == "frozen"
        # Between two long steps a rank is outside any collective for a while: not a suspect.
        # Before its first step, a compile or a checkpoint load may keep it far longer than its
        # peers, who wait in the first collective: a suspect once they waited past that bar.
        first_step_ok = v.last_step or longest_wait > cfg.first_step_suspect_after_s
        v.suspect = bool(outside and first_step_ok
                         and stalled > max(cfg.suspect_after_s, cfg.stuck_after_steps * v.step_time))
        if v.suspect and v.state == "starting" and stalled > v.stuck_after(cfg):
            v.state = "stuck"   # its peers wait for it: a start-up hang


class RecentStepTimes:
    """Each rank process's recent step durations, one per step the exporter saw end (from its
    last-step gauges), so that a rank's own pace sets how long a pause is a stall."""

    KEEP = 16

    def __init__(self) -> None:
        self._seen: dict[tuple[str, int, int], deque[tuple[float, float]]] = {}
        self._lock = threading.Lock()

    def longest(self, run_dir: Path, reg: Registration, last_step_at: float, duration: float) -> float:
        """Note the rank's last step (once per step) and return the longest recent one."""
        with self._lock:
            seen = self._seen.setdefault((str(run_dir), reg.rank, reg.pid), deque(maxlen=self.KEEP))
            if duration > 0 and last_step_at and (not seen or seen[-1][0] != last_step_at):
                seen.append((last_step_at, duration))
            return max((d for _, d in seen), default=0.0)

    def forget_except(self, run_dirs: Iterable[Path]) -> None:
        keep = {str(p) for p in run_dirs}
        with self._lock:
            for key in [k for k in self._seen if k[0] not in keep]:
                del self._seen[key]


class RankCollector:
    """A prometheus_client collector over every run directory under ``cfg.directory``."""

    def __init__(self, cfg: ExporterConfig, evidence: EvidenceKeeper | None = None):
        self.cfg = cfg
        self.evidence = evidence   # what it captured refines the states (a thread in its own code)
        self.state_counts: dict[str, int] = dict.fromkeys(RANK_STATES, 0)
        self.reader = Reader()
        self.step_times = RecentStepTimes()
        # The scrape and the janitor (expired_run_dirs) share the reader's caches.
        self._lock = threading.Lock()

    def watch(self, now: float) -> None:
        """The janitor's look at the ranks, between scrapes: each run with a live process, or a
        rank that failed, is read as a scrape reads it, and what its ranks do goes to the
        evidence keeper (which captures, on its own thread, what a stalled rank shows)."""
        if self.evidence is None:
            return
        run_dirs = self.run_dirs()
        self.evidence.forget(run_dirs)
        for run_dir in run_dirs:
            registrations = load_registrations(run_dir)
            if not any(reg.process_alive() or (reg.failed_at and now - reg.failed_at < self.cfg.retention_s)
                       for reg in registrations):
                continue
            views, merged = self._collect_run(run_dir, now)
            self.evidence.observe(run_dir, views, _process_groups(merged), now)

    def run_dirs(self) -> list[Path]:
        return sorted(p.parent for p in self.cfg.directory.glob(f"*/{RANKS_SUBDIR}") if p.is_dir())

    def collect(self) -> Iterator[Metric]:
        """One scrape. It only reads: removing files is the janitor's (expired_run_dirs)."""
        now = time.time()
        families = _derived_families()
        counts = dict.fromkeys(RANK_STATES, 0)
        run_dirs = self.run_dirs()
        with self._lock:
            self.reader.forget_except(run_dirs)
        self.step_times.forget_except(run_dirs)
        for run_dir in run_dirs:
            views, merged = self._collect_run(run_dir, now)
            yield from reduce_histograms(merged, self.cfg.rank_histograms)
            for v in views:
                counts[v.state] += 1
                _add_view(families, v, now)
        self.state_counts = counts
        yield from families.values()

    def expired_run_dirs(self, now: float) -> list[Path]:
        """Runs whose ranks have all been gone (dead or finished) for longer than the retention."""
        expired = []
        for run_dir in self.run_dirs():
            # A live process keeps its run; checking first spares a merge of its files.
            if any(reg.process_alive() for reg in load_registrations(run_dir)):
                continue
            views, _ = self._collect_run(run_dir, now)
            if views and now - max(_last_seen(v) for v in views) > self.cfg.retention_s:
                expired.append(run_dir)
        return expired

    def _collect_run(self, run_dir: Path, now: float) -> tuple[list[RankView], list[Metric]]:
        registrations = load_registrations(run_dir)
        latest = latest_per_rank(registrations)
        latest_pids = {str(r.pid) for r in latest.values()}
        alive = {(reg.rank, reg.pid): reg.process_alive() for reg in registrations}   # one per registration file
        live_pids = {pid for (_, pid), up in alive.items() if up}
        dead_pids = {pid for _, pid in alive} - live_pids
        # A dead process's live* gauges (heartbeat, in-flight) are left out of
        # the merge, as prometheus_client's mark_process_dead would, but without
        # deleting them; its counters and histograms stay so rates do not reset.
        files = sorted(f for f in glob.glob(str(run_dir / "*.db"))
                       if not (Path(f).name.startswith("gauge_live") and db_file_pid(Path(f)) in dead_pids))
        with self._lock:
            merged = self.reader.merge(run_dir, files)
        index = _index(merged)
        views = []
        for rank, reg in sorted(latest.items()):
            key = (reg.run, str(reg.rank))
            v = RankView(reg=reg, alive=alive[(reg.rank, reg.pid)])
            v.heartbeat = index.get(("rankscope_heartbeat_timestamp_seconds",) + key, 0.0)
            v.last_step = index.get(("rankscope_last_step_timestamp_seconds",) + key, 0.0)
            v.block_since = max((index.get(("rankscope_block_started_timestamp_seconds",) + key + (block,), 0.0)
                                 for block in BLOCKS), default=0.0)
            v.block_ended = index.get(("rankscope_block_ended_timestamp_seconds",) + key, 0.0)
            v.step_time = self.step_times.longest(
                run_dir, reg, v.last_step, index.get(("rankscope_step_last_duration_seconds",) + key, 0.0))
            for op in COLLECTIVE_OPS:
                flag = index.get(("rankscope_collective_in_flight",) + key + (op,))
                if flag is not None and op not in v.ops:
                    v.ops.append(op)
                if flag is not None and flag >= 1:
                    v.in_flight[op] = index.get(("rankscope_collective_started_timestamp_seconds",) + key + (op,),
                                                now) or now
            if not v.alive:
                v.in_flight.clear()
            if self.evidence is not None and v.in_flight and self.evidence.outside_collective(run_dir, reg):
                # Counted in a collective from its backward phase on, but the evidence of this
                # stall found its training thread in the job's own code: it waits in none.
                v.in_flight.clear()
            views.append(v)
        derive_states(views, self.cfg, now)
        # Older processes of a restarted rank keep their counters (summed by the
        # merge) but not their identity series.
        for metric in merged:
            if metric.name == "rankscope_rank_info":
                if isinstance(metric, MergedFamily):
                    metric.keep_only("process_id", latest_pids)
                else:
                    metric.samples = [s for s in metric.samples if s.labels.get("process_id") in latest_pids]
        return views, merged


def _process_groups(merged: Iterable[Metric]) -> dict[str, list[dict]]:
    """rank -> its process groups' last enqueued and completed sequence numbers (for evidence)."""
    names = {"rankscope_process_group_last_enqueued_seq": "enqueued",
             "rankscope_process_group_last_completed_seq": "completed"}
    groups: dict[tuple[str, str, str], dict] = {}
    for metric in merged:
        if metric.name not in names:
            continue
        samples = ((dict(labels), value) for _, labels, value in metric.items()) if isinstance(metric, MergedFamily) \
            else ((s.labels, s.value) for s in metric.samples)
        for labels, value in samples:
            key = (labels.get("rank", ""), labels.get("group", ""), labels.get("group_id", ""))
            entry = groups.setdefault(key, {"group": key[1], "group_id": key[2]})
            entry[names[metric.name]] = int(value)
    out: dict[str, list[dict]] = {}
    for (rank, _, _), entry in sorted(groups.items()):
        out.setdefault(rank, []).append(entry)
    return out


def _last_seen(v: RankView) -> float:
    """When the rank last showed signs of life."""
    return v.reg.finished_at or v.reg.failed_at or v.last_step or v.heartbeat or v.reg.started_at


def _index(merged: Iterable[Metric]) -> dict[tuple, float]:
    """(metric name, run, rank[, op]) -> value, for the series the states are derived from."""
    wanted = {"rankscope_heartbeat_timestamp_seconds", "rankscope_last_step_timestamp_seconds",
              "rankscope_step_last_duration_seconds", "rankscope_block_started_timestamp_seconds",
              "rankscope_block_ended_timestamp_seconds",
              "rankscope_collective_in_flight", "rankscope_collective_started_timestamp_seconds"}
    out: dict[tuple, float] = {}
    for metric in merged:
        if metric.name not in wanted:
            continue
        if isinstance(metric, MergedFamily):
            for _, labels, value in metric.items():
                labels = dict(labels)
                key = (metric.name, labels.get("run", ""), labels.get("rank", ""))
                out[key + _detail(labels)] = value
            continue
        for s in metric.samples:
            key = (metric.name, s.labels.get("run", ""), s.labels.get("rank", ""))
            out[key + _detail(s.labels)] = s.value
    return out


def _detail(labels: dict[str, str]) -> tuple[str, ...]:
    """The label that tells a metric's series of one rank apart: its op or its block."""
    for name in ("op", "block"):
        if name in labels:
            return (labels[name],)
    return ()


def _derived_families() -> dict[str, GaugeMetricFamily]:
    names = ("rankscope_rank_up", "rankscope_rank_state", "rankscope_hang_suspect",
             "rankscope_step_stalled_seconds", "rankscope_heartbeat_age_seconds",
             "rankscope_collective_in_flight_seconds", "rankscope_rank_failure_info",
             "rankscope_rank_failed_timestamp_seconds")
    return {n: GaugeMetricFamily(n, EXPORTER_SPECS[n].help, labels=EXPORTER_SPECS[n].label_names) for n in names}


def _add_view(families: dict[str, GaugeMetricFamily], v: RankView, now: float) -> None:
    ident = [v.reg.labels[k] for k in IDENTITY_LABELS]
    families["rankscope_rank_up"].add_metric(ident, 1.0 if v.alive else 0.0)
    for state in RANK_STATES:
        families["rankscope_rank_state"].add_metric(ident + [state], 1.0 if v.state == state else 0.0)
    families["rankscope_hang_suspect"].add_metric(ident, 1.0 if v.suspect else 0.0)
    if v.reg.exception:
        families["rankscope_rank_failure_info"].add_metric(ident + [v.reg.exception], 1.0)
        if v.reg.failed_at:
            families["rankscope_rank_failed_timestamp_seconds"].add_metric(ident + [v.reg.exception], v.reg.failed_at)
    if v.state in ENDED_STATES:
        return
    families["rankscope_step_stalled_seconds"].add_metric(ident, max(now - v.progress_at, 0.0))
    if v.heartbeat:
        families["rankscope_heartbeat_age_seconds"].add_metric(ident, max(now - v.heartbeat, 0.0))
    for op in v.ops:
        since = v.in_flight.get(op)
        families["rankscope_collective_in_flight_seconds"].add_metric(ident + [op], max(now - since, 0.0)
                                                                      if since else 0.0)
