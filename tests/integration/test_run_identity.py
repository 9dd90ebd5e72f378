"""Every job is its own run, every collective is counted, nothing is left behind
(real torchrun jobs, tests/loops/collectives_job.py).

- Two 2-rank jobs launched at once the way multi-node jobs are (torchrun
  ``--master-addr/--master-port``: static rendezvous, run id "none"), with no
  RANKSCOPE_RUN and no scheduler: two runs, each with exactly its own counts,
  both served by the node's one exporter. The same job relaunched counts from 0;
  a second live job forced onto a run id in use is refused, naming both, and the
  first keeps its counts.
- A scheduler's id wins over the endpoint (Slurm, Kubernetes/Volcano-style).
- The last collectives are counted whatever order the job tears down in.
- The auto-started exporter leaves no finished run's files behind.
- A job's console has no line from rankscope or torch's worker server.
- A second user on the node, whose port another user's exporter holds, gets
  its own exporter and is told where.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.jobs import free_port, scrape, select, wait_until
from tests.helpers.userjob import LOOPS, UserJob, listen_port

STEPS = 40
RANKS = ("0", "1")


def static_rendezvous(master_port: int, *args: str) -> list[str]:
    """torchrun as multi-node jobs are launched: static rendezvous, one node of two ranks."""
    torchrun = Path(sys.executable).parent / "torchrun"
    return [str(torchrun), "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(master_port), str(LOOPS / "collectives_job.py"), *args]


def no_run_id(**extra: str) -> dict[str, str]:
    """A user's environment names no run (UserJob sets RANKSCOPE_RUN; empty is unset)."""
    return {"RANKSCOPE_RUN": "", **extra}


def steps_of(samples, run: str) -> dict[str, float]:
    return {s.labels["rank"]: s.value for s in select(samples, "rankscope_steps_total", run=run)}


def test_two_static_rendezvous_jobs_at_once_are_two_runs_and_a_relaunch_counts_anew(tmp_path):
    metrics, port = tmp_path / "metrics", listen_port()
    hold_a, hold_b = tmp_path / "hold-a", tmp_path / "hold-b"
    hold_a.mkdir(), hold_b.mkdir()
    ports = free_port(), free_port()
    runs = [f"127.0.0.1:{p}" for p in ports]
    with UserJob("collectives_job.py", tmp_path=tmp_path, nproc=2, metrics_dir=metrics, port=port, name="a",
                 env=no_run_id(LOOP_HOLD=str(hold_a))) as a, \
            UserJob("collectives_job.py", tmp_path=tmp_path, nproc=2, metrics_dir=metrics, port=port, name="b",
                    env=no_run_id(LOOP_HOLD=str(hold_b))) as b:
        a.start(static_rendezvous(ports[0], "--steps", str(STEPS), "--step-delay", "0.05"))
        b.start(static_rendezvous(ports[1], "--steps", str(STEPS), "--step-delay", "0.05"))
        for job, hold in ((a, hold_a), (b, hold_b)):
            for r in RANKS:
                assert job.wait_for_file(hold / f"holding{r}", timeout=120), job.log()[-3000:]
        # Both jobs still running, both on the node's one exporter.
        samples = wait_until(lambda: (lambda s: all(steps_of(s, run) == dict.fromkeys(RANKS, STEPS) for run in runs)
                                      and s)(scrape(a.url)), timeout=15, what="both runs' final counts")
        assert {s.labels["run"] for s in select(samples, "rankscope_steps_total")} == set(runs)
        assert {r["run"] for r in a.results().values()} == {runs[0]}
        assert {r["run"] for r in b.results().values()} == {runs[1]}
        (hold_a / "release").touch(), (hold_b / "release").touch()
        a.wait(timeout=60), b.wait(timeout=60)
        # The same job again (same endpoint): a relaunch of its run, counted from 0.
        a.start(static_rendezvous(ports[0], "--steps", "10"))
        (hold_a / "release").touch()
        a.wait(timeout=120)
        samples = wait_until(lambda: (lambda s: steps_of(s, runs[0]) == dict.fromkeys(RANKS, 10) and s)(scrape(a.url)),
                             timeout=15, what="the relaunch's own count")
        assert steps_of(samples, runs[1]) == dict.fromkeys(RANKS, STEPS)   # the other run untouched


def test_a_second_live_job_on_a_run_id_in_use_is_refused_and_the_first_keeps_its_counts(tmp_path):
    metrics, port, hold = tmp_path / "metrics", listen_port(), tmp_path / "hold"
    hold.mkdir()
    same = {"RANKSCOPE_RUN": "shared-name"}
    with UserJob("collectives_job.py", tmp_path=tmp_path, nproc=2, metrics_dir=metrics, port=port, name="first",
                 env=same | {"LOOP_HOLD": str(hold)}) as first, \
            UserJob("collectives_job.py", tmp_path=tmp_path, nproc=2, metrics_dir=metrics, port=port, name="second",
                    env=same) as second:
        first.start(static_rendezvous(free_port(), "--steps", str(STEPS)))
        for r in RANKS:
            assert first.wait_for_file(hold / f"holding{r}", timeout=120), first.log()[-3000:]
        second.start(static_rendezvous(free_port(), "--steps", str(STEPS)))
        assert second.wait(timeout=120, check=False) != 0
        log = second.log()
        assert "run: run 'shared-name' on node" in log and "is already used by a job that is still running" in log, log
        assert "RANKSCOPE_RUN" in log, log
        samples = scrape(first.url)
        assert steps_of(samples, "shared-name") == dict.fromkeys(RANKS, STEPS)   # nothing added, nothing lost
        (hold / "release").touch()
        first.wait(timeout=60)


@pytest.mark.parametrize("scheduler, expected", [({"SLURM_JOB_ID": "880021"}, "880021"),
                                                 ({"JOB_NAME": "llama-pretrain-7"}, "llama-pretrain-7")],
                         ids=["slurm", "kubernetes"])
def test_a_scheduler_id_names_the_run(tmp_path, scheduler, expected):
    with UserJob("collectives_job.py", tmp_path=tmp_path, nproc=2, env=no_run_id(**scheduler)) as job:
        job.start(static_rendezvous(free_port(), "--steps", "5"))
        job.wait(timeout=120)
        assert {r["run"] for r in job.results().values()} == {expected}
        samples = wait_until(lambda: (lambda s: steps_of(s, expected) == dict.fromkeys(RANKS, 5) and s)(job.scrape()),
                             timeout=15, what="the run's counts")
        assert steps_of(samples, expected) == dict.fromkeys(RANKS, 5)


@pytest.mark.parametrize("teardown", ["close-first", "destroy-first", "destroy-never-close"])
def test_every_collective_is_counted_whatever_order_the_job_tears_down_in(tmp_path, teardown):
    """torch's flight recorders outlive the process groups: a job that destroys its groups
    before closing the Monitor (torchtitan's order), or never closes it, still has its last
    collectives counted (before: 0 of 100 per rank when destroyed first)."""
    steps = 50
    with UserJob("collectives_job.py", "--steps", str(steps), "--teardown", teardown, tmp_path=tmp_path,
                 nproc=2) as job:
        job.run(timeout=120)
        for op in ("all_reduce", "all_gather"):
            counted = {s.labels["rank"]: s.value for s in job.series(
                job.scrape(), "rankscope_process_group_collectives_total", group="default", op=op)}
            assert counted == dict.fromkeys(RANKS, steps), (op, counted)


def test_the_auto_started_exporter_leaves_no_finished_run_behind_and_the_console_stays_quiet(tmp_path):
    """The exporter stays until the finished run is past its retention, removes its files,
    then exits; the whole job printed nothing from rankscope or torch's worker server."""
    metrics = tmp_path / "metrics"
    with UserJob("collectives_job.py", "--steps", "20", tmp_path=tmp_path, nproc=2, metrics_dir=metrics,
                 env={"RANKSCOPE_EXIT_WHEN_IDLE_S": "1", "RANKSCOPE_RETENTION_S": "6"}) as job:
        job.run(timeout=120)
        console = job.log()
        noise = [line for line in console.splitlines()
                 if "rankscope" in line.lower() or "WorkerServer" in line or "[c10d]" in line]
        assert noise == [], console[-3000:]
        samples = job.scrape()   # served after the run, while its retention lasts
        assert steps_of(samples, job.run_id) == dict.fromkeys(RANKS, 20)
        exporter = job.exporter_pid
        assert exporter
        run_dir = next(metrics.glob("*/ranks")).parent
        ended = time.time()
        wait_until(lambda: not _alive(exporter), timeout=40, what="the idle exporter to exit")
        assert time.time() - ended >= 3, "it exited before the finished run's retention was over"
        assert not run_dir.exists(), sorted(p.name for p in run_dir.rglob("*"))
        assert "exporter.log" in {p.name for p in metrics.iterdir()}
        assert "exporter.json" not in {p.name for p in metrics.iterdir()}   # its address, forgotten at exit
        log = (metrics / "exporter.log").read_text()
        assert f"removing {run_dir}" in log and "exiting" in log, log[-2000:]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


OTHER_USER = "rankscope-other"


@pytest.fixture
def other_user():
    """A second user of the node (created here, removed after)."""
    if os.getuid() != 0:
        pytest.skip("needs root to act as a second user")
    created = False
    try:
        pwd.getpwnam(OTHER_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER_USER],
                       check=True, capture_output=True)
        created = True
    entry = pwd.getpwnam(OTHER_USER)
    try:
        yield entry
    finally:
        if created:
            subprocess.run(["userdel", OTHER_USER], check=False, capture_output=True)


def test_a_second_user_whose_port_is_taken_gets_its_own_exporter_and_is_told_where(tmp_path, other_user):
    """Two users on one node, each with their own metrics directory, and the same port: the
    other user's exporter holds it; this user's job starts its own exporter on a free port,
    says so once with the URL, and its metrics are served there (never silently lost, never
    mixed into the other's)."""
    import tempfile

    port = listen_port()
    home = Path(tempfile.mkdtemp(prefix="rankscope-other-user-"))   # outside pytest's root-only tmp tree
    home.chmod(0o755)
    os.chown(home, other_user.pw_uid, other_user.pw_gid)
    theirs = _exporter_as(other_user, home / "metrics", port)
    try:
        wait_until(lambda: _health(port), timeout=30, what="the other user's exporter")
        assert _health(port)["uid"] == other_user.pw_uid
        with UserJob("collectives_job.py", "--steps", "10", tmp_path=tmp_path, nproc=2, port=port,
                     name="mine") as job:
            job.run(timeout=120)
            told = [line for line in job.log().splitlines() if "another user's exporter" in line]
            assert len(told) == 1, job.log()[-3000:]
            url = told[0].split("node exporter serves ")[1].split(" ")[0]
            assert url.startswith("http://127.0.0.1:") and f":{port}/" not in url, told
            try:
                samples = wait_until(lambda: (lambda s: steps_of(s, job.run_id) == dict.fromkeys(RANKS, 10)
                                              and s)(scrape(url)),
                                     timeout=15, what="this user's run on its own exporter")
                assert steps_of(samples, job.run_id)
                assert not select(scrape(f"http://127.0.0.1:{port}/metrics"), "rankscope_steps_total",
                                  run=job.run_id)
                recorded = job.metrics_dir / "exporter.json"   # where `rankscope top` and later jobs find it
                assert f'"port": {url.rsplit(":", 1)[1].split("/")[0]}' in recorded.read_text(), recorded.read_text()
            finally:
                _kill_exporter_at(url)
    finally:
        theirs.kill()
        theirs.wait(timeout=10)
        shutil.rmtree(home, ignore_errors=True)


def _exporter_as(user, directory: Path, port: int) -> subprocess.Popen:
    """The node exporter run by ``user``, with the system's Python (this venv's interpreter lives
    under /root, which another user cannot enter) and this venv's packages."""
    import sysconfig

    site = sysconfig.get_paths()["purelib"]
    start = ("import runpy, site, sys; site.addsitedir(sys.argv[1]); "
             "sys.argv = ['rankscope-exporter', '--port', sys.argv[2], '--dir', sys.argv[3], '--no-nvml']; "
             "runpy.run_module('rankscope.exporter', run_name='__main__')")
    python = shutil.which("python3", path="/usr/bin:/usr/local/bin") or sys.executable
    env = {"PATH": "/usr/bin:/bin", "HOME": str(directory.parent)}
    return subprocess.Popen(["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups",
                             python, "-c", start, site, str(port), str(directory)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _health(port: int) -> dict | None:
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as resp:
            return json.loads(resp.read())
    except OSError:
        return None


def _kill_exporter_at(metrics_url: str) -> None:
    try:
        os.kill(_health_pid(metrics_url), 9)
    except (OSError, ValueError):
        pass


def _health_pid(metrics_url: str) -> int:
    import json
    import urllib.request

    with urllib.request.urlopen(metrics_url.replace("/metrics", "/healthz"), timeout=2) as resp:
        return int(json.loads(resp.read())["pid"])
