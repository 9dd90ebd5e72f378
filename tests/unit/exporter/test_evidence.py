"""Issue 31's parts in one process: the stack signal's parsing and registration, faulthandler's
dump as threads and places, and the exporter's EvidenceKeeper (episodes, caps, captures of
this very process). The whole path, with real jobs, Prometheus and Alertmanager, is
tests/drills/test_evidence.py."""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from rankscope.console import evidence as console_evidence
from rankscope.contract.environment import ConfigError
from rankscope.contract.rundir import Registration, process_start_ticks
from rankscope.exporter import evidence
from rankscope.exporter.config import ExporterConfig
from rankscope.publishing.stacks import StackDumps, parse_signal

SIGNAL = "SIGRTMIN+9"


@pytest.fixture
def quick(monkeypatch):
    """Captures of this process in a fraction of a second."""
    monkeypatch.setattr(evidence, "CPU_SAMPLE_S", 0.02)
    monkeypatch.setattr(evidence, "STACK_WAIT_S", 2.0)


def registration(pid: int | None = None, rank: int = 1, **kw) -> Registration:
    pid = pid or os.getpid()
    return Registration(run="r", rank=rank, local_rank=rank, node="n", world_size=2, local_world_size=2, pid=pid,
                        pid_start_ticks=process_start_ticks(pid), agent_pid=1, agent_start_ticks=None,
                        started_at=time.time(), **kw)


def view(reg: Registration, state: str, suspect: bool = False, in_flight: dict | None = None):
    return SimpleNamespace(reg=reg, state=state, suspect=suspect, in_flight=in_flight or {})


def keeper(tmp_path: Path, **cfg) -> evidence.EvidenceKeeper:
    return evidence.EvidenceKeeper(ExporterConfig(directory=tmp_path, nvml=False, **cfg))


def wait_for_captures(k: evidence.EvidenceKeeper, n: int, timeout: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = k.captures()
        if len(found) >= n:
            return found
        time.sleep(0.02)
    return k.captures()


# -- the signal -----------------------------------------------------------------------------
@pytest.mark.parametrize("text, number", [("SIGUSR2", signal.SIGUSR2), ("usr1", signal.SIGUSR1),
                                          ("SIGRTMIN+9", signal.SIGRTMIN + 9), ("SIGRTMAX-2", signal.SIGRTMAX - 2),
                                          (str(int(signal.SIGUSR2)), signal.SIGUSR2), ("off", 0), ("", 0)])
def test_a_stack_signal_is_read_by_name_number_or_off(text, number):
    assert parse_signal(text) == number


@pytest.mark.parametrize("text", ["SIGTERM", "sigint", "SIGKILL", "SIGSTOP", "SIGQUIT", "SIGCHLD", "15"])
def test_a_signal_jobs_or_launchers_use_is_refused_at_start(text):
    with pytest.raises(ConfigError, match="jobs, launchers or Python itself use"):
        parse_signal(text)


@pytest.mark.parametrize("text", ["SIGNOPE", "99999", "RTMIN+999", "-3"])
def test_a_signal_this_system_lacks_is_refused_at_start(text):
    with pytest.raises(ConfigError, match="not a signal of this system"):
        parse_signal(text)


def test_the_handler_writes_every_threads_stack_without_the_gil(tmp_path):
    """faulthandler's C handler answers while this thread waits in C; the dump names the
    functions, and neither a local variable's value nor an argument."""
    reg = registration()
    dumps = StackDumps(tmp_path, reg, parse_signal(SIGNAL))
    dumps.start()
    try:
        assert reg.stacks["signal"] == signal.SIGRTMIN + 9 and Path(reg.stacks["file"]).exists()
        secret = "hunter2-local-value"
        ready, release = threading.Event(), threading.Event()

        def waiting_in_c(token: str) -> None:
            ready.set()
            release.wait(10)
        other = threading.Thread(target=waiting_in_c, args=(secret,), name="waiter")
        other.start()
        ready.wait(5)
        os.kill(os.getpid(), reg.stacks["signal"])
        deadline = time.monotonic() + 5
        while "waiting_in_c" not in Path(reg.stacks["file"]).read_text() and time.monotonic() < deadline:
            time.sleep(0.01)
        release.set()
        other.join()
        text = Path(reg.stacks["file"]).read_text()
        threads = evidence.parse_stacks(text)
        assert len(threads) >= 2
        mine = next(t for t in threads if t["id"] == reg.stacks["thread"])
        assert any(f[2] == "test_the_handler_writes_every_threads_stack_without_the_gil" for f in mine["frames"])
        assert any(f[2] == "waiting_in_c" for t in threads for f in t["frames"])
        assert secret not in text and "token" not in text
    finally:
        dumps.stop()
    assert signal.getsignal(signal.SIGRTMIN + 9) == signal.SIG_DFL


def test_a_job_that_handles_the_signal_keeps_its_handler(tmp_path, caplog):
    ran = []
    signum = parse_signal("SIGUSR2")
    previous = signal.signal(signum, lambda *_: ran.append(True))
    try:
        reg = registration()
        with caplog.at_level(logging.WARNING, logger="rankscope"):
            dumps = StackDumps(tmp_path, reg, signum)
            dumps.start()
        assert reg.stacks == {"unavailable": "the job handles SIGUSR2 itself"}
        assert "leaves it alone" in caplog.text
        os.kill(os.getpid(), signum)
        deadline = time.monotonic() + 5
        while not ran and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ran == [True]
        dumps.stop()
    finally:
        signal.signal(signum, previous)


def test_a_job_that_takes_the_signal_later_is_never_sent_it_again(tmp_path, caplog):
    signum = parse_signal("SIGUSR1")
    reg = registration()
    dumps = StackDumps(tmp_path, reg, signum)
    dumps.start()
    assert reg.stacks.get("signal") == signum
    previous = signal.signal(signum, lambda *_: None)   # the job's own, after rankscope's
    try:
        with caplog.at_level(logging.WARNING, logger="rankscope"):
            dumps.check()
            dumps.check()
        assert "installed its own SIGUSR1 handler" in reg.stacks["unavailable"]
        saved = json.loads(next((tmp_path / "ranks").glob("*.json")).read_text())
        assert saved["stacks"] == reg.stacks   # the exporter reads the withdrawn offer
        assert caplog.text.count("stops asking this rank for stacks") == 1
        dumps.stop()
        assert signal.getsignal(signum) is not signal.SIG_DFL   # the job's handler stays
    finally:
        signal.signal(signum, previous)


# -- reading a dump -------------------------------------------------------------------------
def test_a_real_dump_parses_into_threads_and_places(tmp_path):
    path = tmp_path / "dump.txt"
    with open(path, "w") as f:
        faulthandler.dump_traceback(f, all_threads=True)
    threads = evidence.parse_stacks(path.read_text())
    current = [t for t in threads if t["current"]]
    assert len(current) == 1 and current[0]["id"] == threading.get_ident()
    file, line, function = current[0]["frames"][0]
    assert file == __file__ and function == "test_a_real_dump_parses_into_threads_and_places" and line > 0


@pytest.mark.parametrize("innermost, place", [
    ("/x/site-packages/torch/distributed/distributed_c10d.py", "collective"),
    ("/x/site-packages/torch/autograd/graph.py", "backward"),
    ("/x/site-packages/torch/utils/data/dataloader.py", "data loader"),
    ("/x/site-packages/torch/nn/modules/module.py", "torch"),
    ("/home/me/train.py", "user code"),
    ("/usr/lib/python3.11/re/__init__.py", "user code"),
])
def test_where_a_thread_is_comes_from_its_innermost_frame(innermost, place):
    assert evidence.where([[innermost, 1, "f"], ["/home/me/train.py", 9, "main"]]) == place
    assert evidence.where([]) == "unknown"


@pytest.mark.parametrize("state, suspect, failed, trigger", [
    ("progressing", False, False, None), ("starting", False, False, None), ("finished", False, False, None),
    ("stuck", False, False, "stuck"), ("stuck_in_collective", False, False, "stuck_in_collective"),
    ("stuck", True, False, "suspect"), ("frozen", True, False, "frozen"),
    ("dead", False, True, "failed"), ("dead", False, False, None),   # killed: no traceback to keep
])
def test_what_starts_an_episode(state, suspect, failed, trigger):
    reg = registration(failed_at=time.time() if failed else None, exception="ValueError" if failed else "")
    assert evidence.trigger_of(state, suspect, reg) == trigger


def test_a_long_text_is_cut_to_its_cap():
    text = "é" * evidence.TEXT_MAX_BYTES
    cut = evidence._cut(text)
    assert len(cut.encode()) <= evidence.TEXT_MAX_BYTES + len("\n... (cut)") and cut.endswith("... (cut)")
    assert evidence._cut("short") == "short" and evidence._cut("") == ""


# -- episodes -------------------------------------------------------------------------------
def test_one_capture_per_episode_however_the_state_flaps(tmp_path, quick):
    run_dir = tmp_path / "run-a"
    run_dir.mkdir()
    reg = registration()
    k = keeper(tmp_path)
    try:
        now = time.time()
        for i, (state, suspect) in enumerate([("stuck_in_collective", False), ("stuck", True), ("frozen", True),
                                              ("stuck", False), ("stuck_in_collective", False)]):
            k.observe(run_dir, [view(reg, state, suspect, {"all_reduce": now})], {}, now + i)
        (first,) = wait_for_captures(k, 1)
        assert first["episode"] == 1 and first["trigger"] == "stuck_in_collective"
        assert first["collectives"]["in_flight"] == {"all_reduce": now}
        assert first["stacks"]["source"] == "unavailable"   # this process offers none: nothing was sent
        assert first["process"]["state"] in ("R", "S") and first["process"]["threads"] >= 2
        k.observe(run_dir, [view(reg, "progressing")], {}, now + 10)   # progress ends the episode
        k.observe(run_dir, [view(reg, "stuck")], {}, now + 11)
        k.observe(run_dir, [view(reg, "stuck", True)], {}, now + 12)
        second = wait_for_captures(k, 2)[-1]
        assert second["episode"] == 2 and second["trigger"] == "stuck"
        time.sleep(0.3)
        assert len(k.captures()) == 2
        assert k.find("run-a", 1)["episode"] == 2 and k.find("run-a", 1, episode=1)["episode"] == 1
    finally:
        k.stop()


def test_captures_per_run_stop_at_the_cap_and_say_so_once(tmp_path, quick, caplog):
    run_dir = tmp_path / "run-b"
    run_dir.mkdir()
    k = keeper(tmp_path, evidence_max_episodes=2)
    try:
        with caplog.at_level(logging.WARNING, logger="rankscope.exporter"):
            for rank in range(5):
                k.observe(run_dir, [view(registration(rank=rank), "stuck")], {}, time.time())
            wait_for_captures(k, 2)
            time.sleep(0.3)
        assert sorted(c["rank"] for c in k.captures()) == [0, 1]
        assert caplog.text.count("captures already, no more") == 1
        k.forget([])   # the run is gone: its count goes with it
        k.observe(run_dir, [view(registration(rank=3), "stuck")], {}, time.time())
        assert len(wait_for_captures(k, 3)) == 3
    finally:
        k.stop()


def test_a_rank_that_raised_and_exited_keeps_its_traceback(tmp_path, quick):
    run_dir = tmp_path / "run-c"
    run_dir.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    reg = registration(pid=gone.pid, failed_at=time.time(), exception="ValueError",
                       failure="Traceback (most recent call last):\n  ...\nValueError: labels <out> of range\n")
    reg.pid_start_ticks = 1
    k = keeper(tmp_path)
    try:
        k.observe(run_dir, [view(reg, "dead")], {}, time.time())
        (c,) = wait_for_captures(k, 1)
        assert c["trigger"] == "failed" and c["process"] == {"gone": True} and "stacks" not in c
        assert c["failure"]["exception"] == "ValueError" and "labels <out> of range" in c["failure"]["traceback"]
        page = evidence.render_html(c)
        assert "It raised ValueError" in page and "labels &lt;out&gt; of range" in page and "<out>" not in page
        assert console_evidence.one_line(console_evidence.summary({}, c)) == \
            "raised ValueError: labels <out> of range"
    finally:
        k.stop()


def test_a_capture_of_this_process_reads_its_stacks_by_signal(tmp_path, quick):
    """The keeper's whole capture of a live rank: it sends the rank's signal, reads the dump,
    and says where the training thread (here: this test's) is."""
    run_dir = tmp_path / "run-d"
    run_dir.mkdir()
    reg = registration()
    dumps = StackDumps(run_dir, reg, parse_signal(SIGNAL))
    dumps.start()
    k = keeper(tmp_path)
    try:
        k.observe(run_dir, [view(reg, "stuck")], {}, time.time())
        (c,) = wait_for_captures(k, 1)
        assert c["stacks"]["source"] == "signal" and c["stacks"]["training_thread_in"] == "user code"
        training = next(t for t in c["stacks"]["threads"] if t["id"] == c["stacks"]["training_thread"])
        assert any(f[2] == "wait_for_captures" for f in training["frames"])
        assert any(f[2] == "_work" for t in c["stacks"]["threads"] for f in t["frames"])   # the keeper's thread
        assert c["capture_s"] < 5
        deadline = time.monotonic() + 5   # the keeper notes the capture just after writing it
        while not k.outside_collective(run_dir, reg) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert k.outside_collective(run_dir, reg)   # in its own code, not in a collective
    finally:
        k.stop()
        dumps.stop()
