"""Compaction of dead rank processes' multiprocess files.

Every rank process writes its own prometheus_client files (``counter_<pid>.db``,
``histogram_<pid>.db``, ``gauge_<mode>_<pid>.db``), and a restarted rank adds a
new set while the old one must stay: its counts are part of every counter's
total (client_python #367). A run with many restarts would make every scrape
read thousands of files (tests/scale/db_growth.py: 1,000 dead processes, 2,016
files). The exporter's janitor therefore folds the files of dead processes
into one file per type, under one dead process's name:

* **Which processes.** Dead by the exporter's own rule: a registered process
  (``ranks/rank-<N>-<pid>.json``) whose pid and start time no longer match a
  live process (``Registration.process_alive``), dead for ``compact_after_s``
  as seen by this exporter. Files of an unregistered pid are never touched.
* **Grouped by launch.** The processes of one torchrun agent (one launch,
  torchelastic restarts included) are folded together, into the files of the
  group's oldest dead process (its *keeper*), whose registration is kept. So
  the contract's ``remove_previous_launch`` still works: a new launch of the
  run removes the keeper's registration and files with the rest of the old
  launch, and a torchelastic restart (same agent) keeps them, with its counts.
* **Per type, as prometheus_client merges them.** Counters, histograms and
  summaries are summed (``MultiProcessCollector.merge(accumulate=False)``:
  raw bucket counts, no ``_count``). ``mostrecent`` gauges keep, per series,
  the value with the latest timestamp, and that timestamp, so the merge with
  the live processes' files picks the same value. ``live*`` gauges of a dead
  process are deleted, as ``prometheus_client.multiprocess.mark_process_dead``
  does (the exporter already left them out). Gauges in the ``all``, ``min``,
  ``max`` and ``sum`` modes are left as they are (``all`` carries the pid, a
  file name, as a label); rankscope writes none.
* **Atomically for the exporter.** Each compacted file is written by
  prometheus_client's ``MmapedDict`` under a temporary name (not ``*.db``),
  then, holding the scrape lock, moved over the keeper's file with
  ``os.replace`` and the other processes' files removed: a scrape sees either
  the old files or the compacted one, so never a count twice or not at all.
  If a source file changed under it (removed by a new launch), the
  compaction is dropped. Other readers of the directory (a
  ``MultiProcessCollector`` of one's own) are not under that lock and can see
  a count twice during the microseconds between the rename and the last
  removal.
* **Registrations.** The registration of a folded process that is neither a
  keeper nor the newest process of its rank is removed with its files, so a
  scrape does not read (and check the liveness of) every process ever started.

Counts (steps, samples, bucket counts, byte totals below 2**53) are kept
exactly; a float sum (seconds) may differ in its last bit, because the files
are added in another order.
"""

from __future__ import annotations

import fcntl
import glob
import logging
import os
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.multiprocess import MultiProcessCollector

from rankscope.contract.mmap_layout import db_file_pid, db_name, entry_key
from rankscope.contract.rundir import RANKS_SUBDIR, Registration, latest_per_rank, load_registrations, reg_filename
from rankscope.exporter.db_file import DbFile

log = logging.getLogger("rankscope.exporter")

SUMMED = ("counter", "histogram", "summary")
LOCK_NAME = ".compaction.lock"


@dataclass
class Result:
    """What one compaction of a run did."""

    files_removed: int = 0
    files_written: int = 0
    registrations_removed: int = 0
    processes: int = 0
    aborted: str = ""
    written: list[Path] = field(default_factory=list)


def _kind(path: Path) -> tuple[str, str]:
    """(type, gauge mode) from a file name, as prometheus_client reads it."""
    parts = path.name.split("_")
    return parts[0], (parts[1] if parts[0] == "gauge" and len(parts) > 2 else "")


class Compactor:
    """Remembers since when each process has been seen dead; compacts runs on request."""

    def __init__(self, compact_after_s: float = 0.0):
        self.compact_after_s = compact_after_s
        self._dead_since: dict[tuple[Path, int, int | None], float] = {}

    def compact_runs(self, run_dirs: list[Path], lock: threading.Lock | None = None,
                     now: float | None = None) -> dict[Path, Result]:
        now = time.time() if now is None else now
        done = {}
        seen: set[tuple] = set()
        for run_dir in run_dirs:
            result = self.compact_run(run_dir, lock, now, seen)
            if result is not None:
                done[run_dir] = result
        self._dead_since = {k: v for k, v in self._dead_since.items() if k in seen}
        return done

    def compact_run(self, run_dir: Path, lock: threading.Lock | None = None, now: float | None = None,
                    seen: set | None = None) -> Result | None:
        """Compact what is due in one run directory; None when there was nothing to do."""
        now = time.time() if now is None else now
        try:
            lock_fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            return None
        try:
            try:   # another exporter on the same directory may be compacting it
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return None
            return self._compact(run_dir, lock, now, seen if seen is not None else set())
        finally:
            os.close(lock_fd)

    def _compact(self, run_dir: Path, lock, now: float, seen: set) -> Result | None:
        registrations = load_registrations(run_dir)
        alive = {(reg.rank, reg.pid): reg.process_alive() for reg in registrations}
        live_pids = {pid for (_, pid), up in alive.items() if up}
        due: dict[tuple, list[Registration]] = {}
        for reg in registrations:
            if reg.pid in live_pids:
                continue
            key = (run_dir, reg.pid, reg.pid_start_ticks)
            seen.add(key)
            since = self._dead_since.setdefault(key, now)
            if now - since >= self.compact_after_s:
                due.setdefault((reg.agent_pid, reg.agent_start_ticks), []).append(reg)
        if not due:
            return None
        latest = {(r.rank, r.pid) for r in latest_per_rank(registrations).values()}
        by_pid: dict[int, list[Path]] = {}
        for name in glob.glob(str(run_dir / "*.db")):
            pid = db_file_pid(Path(name))
            if pid is not None:
                by_pid.setdefault(pid, []).append(Path(name))
        result = Result()
        for group in due.values():
            self._compact_group(run_dir, group, by_pid, latest, live_pids, lock, result)
        if not (result.files_removed or result.registrations_removed or result.aborted):
            return None
        return result

    def _compact_group(self, run_dir: Path, group: list[Registration], by_pid: dict[int, list[Path]],
                       latest: set, live_pids: set[int], lock, result: Result) -> None:
        pids = {reg.pid for reg in group} - live_pids
        keeper = min((reg for reg in group if reg.pid in pids), key=lambda r: (r.started_at, r.pid))
        sources: dict[str, list[Path]] = {}     # target type -> files folded into it
        dropped: list[Path] = []                # live gauges of dead processes
        for pid in sorted(pids):
            for path in sorted(by_pid.get(pid, [])):
                typ, mode = _kind(path)
                if typ in SUMMED:
                    sources.setdefault(typ, []).append(path)
                elif typ == "gauge" and mode == "mostrecent":
                    sources.setdefault("gauge_mostrecent", []).append(path)
                elif typ == "gauge" and mode.startswith("live"):
                    dropped.append(path)
        # Only the keeper's own (already compacted) files: nothing to fold.
        work = {kind: paths for kind, paths in sources.items()
                if not (len(paths) == 1 and db_file_pid(paths[0]) == keeper.pid)}
        prune = [reg for reg in group if reg.pid in pids and reg.pid != keeper.pid and (reg.rank, reg.pid) not in latest]
        if not work and not dropped and not prune:
            return
        identities = {p: _identity(p) for paths in work.values() for p in paths}
        written: list[tuple[Path, Path | None]] = []    # (temporary file or None: nothing left, target)
        try:
            for kind, paths in work.items():
                target = run_dir / db_name(kind, keeper.pid)
                written.append((_write_compacted(kind, paths, target), target))
            with (lock if lock is not None else nullcontext()):
                changed = [p for p, ident in identities.items() if _identity(p) != ident]
                if changed or not (run_dir / RANKS_SUBDIR / reg_filename(keeper.rank, keeper.pid)).exists():
                    result.aborted = f"{changed[0] if changed else 'the keeper registration'} changed under it"
                    return
                for tmp, target in written:
                    if tmp is not None:
                        os.replace(tmp, target)
                        result.files_written += 1
                        result.written.append(target)
                targets = {target for tmp, target in written if tmp is not None}
                for path in [p for paths in work.values() for p in paths] + dropped:
                    if path in targets:
                        result.files_removed += 1      # replaced by the compacted file
                        continue
                    try:
                        path.unlink()
                        result.files_removed += 1
                    except FileNotFoundError:
                        pass
                remaining = {db_file_pid(Path(p)) for p in glob.glob(str(run_dir / "*.db"))}
                for reg in prune:
                    if reg.pid in remaining:
                        continue          # it still has files compaction leaves (all, min, max, sum gauges)
                    try:
                        (run_dir / RANKS_SUBDIR / reg_filename(reg.rank, reg.pid)).unlink()
                        result.registrations_removed += 1
                    except FileNotFoundError:
                        pass
                result.processes += len(pids)
        finally:
            for tmp, _ in written:
                if tmp is not None and tmp.exists():
                    tmp.unlink()


def _identity(path: Path) -> tuple | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino, st.st_size)


def _write_compacted(kind: str, paths: list[Path], target: Path) -> Path | None:
    """Write the merge of ``paths`` to a temporary file next to ``target``; None if they hold nothing."""
    entries: list[tuple[str, float, float]] = []
    if kind in SUMMED:
        for metric in MultiProcessCollector.merge([str(p) for p in paths], accumulate=False):
            for s in metric.samples:
                names = tuple(s.labels)
                key = entry_key(metric.name, s.name, names, tuple(s.labels[n] for n in names), metric.documentation)
                entries.append((key, s.value, 0.0))
    else:   # mostrecent gauges: the value with the latest timestamp, and that timestamp
        best: dict[tuple, list] = {}
        for path in paths:
            f = DbFile(str(path))
            if not f.refresh():
                continue
            for (metric_name, name, labels, help_text), value, stamp in zip(f.parsed, f.values, f.stamps):
                key = (metric_name, name, labels)
                current = best.get(key)
                if current is None:
                    best[key] = current = [help_text, 0.0, 0.0]
                if current[2] < stamp:      # as MultiProcessCollector: strictly later wins, never-set never does
                    current[1], current[2] = value, stamp
        for (metric_name, name, labels), (help_text, value, stamp) in best.items():
            if stamp > 0:
                key = entry_key(metric_name, name, [k for k, _ in labels], [v for _, v in labels], help_text)
                entries.append((key, value, stamp))
    if not entries:
        return None
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    out = MmapedDict(str(tmp))
    try:
        for key, value, stamp in entries:
            out.write_value(key, value, stamp)
    finally:
        out.close()
    return tmp
