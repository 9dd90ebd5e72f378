"""The run directory (rankscope.contract.rundir): a previous launch's files removed and its
restarts kept, the latest registration per rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rankscope.contract.rundir import (Registration, db_file_pid, latest_per_rank, load_registrations,
                                       process_start_ticks, remove_previous_launch, run_slug)


def _reg(run_dir: Path, rank: int, pid: int, agent: int, started: float = 1.0) -> Registration:
    reg = Registration(run="r", rank=rank, local_rank=rank, node="n", world_size=2, local_world_size=2, pid=pid,
                       pid_start_ticks=process_start_ticks(pid), agent_pid=agent,
                       agent_start_ticks=process_start_ticks(agent), started_at=started)
    reg.save(run_dir)
    return reg


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_previous_launch_files_are_removed_and_restarts_kept(tmp_path):
    old_agent, old_rank = _dead_pid(), _dead_pid()
    _reg(tmp_path, 0, old_rank, old_agent)
    (tmp_path / f"counter_{old_rank}.db").write_bytes(b"x")
    restarted = _dead_pid()   # an earlier process of the current launch (torchelastic restart)
    _reg(tmp_path, 1, restarted, os.getppid())
    (tmp_path / f"counter_{restarted}.db").write_bytes(b"x")
    (tmp_path / f"counter_{os.getpid()}.db").write_bytes(b"x")   # alive: never removed
    orphan = _dead_pid()
    (tmp_path / f"histogram_{orphan}.db").write_bytes(b"x")     # no registration, dead
    removed = remove_previous_launch(tmp_path, os.getppid(), process_start_ticks(os.getppid()))
    names = {p.name for p in removed}
    assert f"counter_{old_rank}.db" in names and f"histogram_{orphan}.db" in names
    assert (tmp_path / f"counter_{restarted}.db").exists() and (tmp_path / f"counter_{os.getpid()}.db").exists()
    assert [r.pid for r in load_registrations(tmp_path)] == [restarted]


def test_latest_per_rank_and_helpers(tmp_path):
    a = _reg(tmp_path, 0, _dead_pid(), os.getppid(), started=1.0)
    b = _reg(tmp_path, 0, os.getpid(), os.getppid(), started=2.0)
    latest = latest_per_rank(load_registrations(tmp_path))
    assert latest[0].pid == b.pid != a.pid and latest[0].process_alive()
    assert db_file_pid(Path("gauge_livemostrecent_123.db")) == 123 and db_file_pid(Path("x.db")) is None
    assert run_slug("job-1.2_a") == "job-1.2_a"
    assert run_slug("a/b") != run_slug("a_b") and "/" not in run_slug("a/b")
