"""Start-up never fails because of the node exporter (rankscope.launch).

The rank's Monitor() starts the node's exporter where none answers. An exporter that
cannot start (here: a setting it refuses, so it exits at once, as a crash would) once made
Monitor() raise and the job die; now the rank warns, trains, and a background thread
starts the exporter once more before it says it gave up.
"""

from __future__ import annotations

import logging
import time

from tests.helpers.jobs import free_port

from rankscope import Monitor
from rankscope.launch import START_WAIT_S


def test_an_exporter_that_dies_at_start_warns_and_the_rank_trains(tmp_path, monkeypatch, caplog):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANKSCOPE_STUCK_AFTER_S", "soon")   # the exporter refuses it and exits 2
    port = free_port()
    with caplog.at_level(logging.WARNING, logger="rankscope"):
        t0 = time.monotonic()
        m = Monitor(exporter="auto", metrics_port=port, metrics_dir=tmp_path, run="dead-exporter",
                    publish_interval_s=60)
        started_in = time.monotonic() - t0
        try:
            for _ in range(3):
                with m.step() as step:
                    step.observe(loss=1.0)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not any("did not start" in r.message for r in caplog.records):
                time.sleep(0.2)
            m.parts.publisher.publish()
            assert m.parts.metrics.steps._value.get() == 3
        finally:
            m.close()
    messages = [r.message for r in caplog.records]
    assert started_in < START_WAIT_S + 3, started_in           # the rank waited a bounded time, then trained
    assert any("exited at start (code 2)" in msg for msg in messages), messages
    gave_up = [msg for msg in messages if "did not start" in msg]
    assert len(gave_up) == 1 and "RANKSCOPE_STUCK_AFTER_S" in gave_up[0], gave_up   # the exporter's own error
    log = (tmp_path / "exporter.log").read_text()
    assert log.count("RANKSCOPE_STUCK_AFTER_S") >= 2, log       # started once more before giving up


def test_a_job_starts_and_trains_to_the_end_beside_a_stopped_exporter(tmp_path):
    """The node exporter stopped (SIGSTOP: a debugger, a cgroup freeze, a machine in swap) when a
    job starts, and again while it runs: its port accepts connections and answers nothing.
    The job trains to the end (it once died at Monitor(): 'metrics_port: cannot reach ...:
    timed out'); the exporter, continued, serves every step of every rank."""
    import os
    import signal

    from tests.helpers.exporter_proc import ExporterProcess
    from tests.helpers.jobs import TrainJob, value, wait_until

    steps = 40
    metrics = tmp_path / "metrics"
    with ExporterProcess(metrics) as exporter:
        os.kill(exporter.proc.pid, signal.SIGSTOP)
        try:
            with TrainJob(nproc=2, steps=steps, port=exporter.port, metrics_dir=metrics,
                          env={"RANKSCOPE_EXPORTER": "auto"}) as job:
                # Said, not raised: local rank 0's Monitor() found the port silent.
                wait_until(lambda: "does not answer" in job.log() or job.proc.poll() is not None, timeout=120,
                           what="the warning")
                assert "does not answer" in job.log(), job.log()[-3000:]
                os.kill(exporter.proc.pid, signal.SIGCONT)   # a while of serving, then stopped again
                time.sleep(1.0)
                os.kill(exporter.proc.pid, signal.SIGSTOP)
                assert job.wait(timeout=240) == 0, job.log()[-3000:]
        finally:
            os.kill(exporter.proc.pid, signal.SIGCONT)
        samples = wait_until(lambda: _all_steps(exporter.url, steps), timeout=30, what="every step served")
    assert {value(samples, "rankscope_steps_total", rank=r) for r in ("0", "1")} == {float(steps)}


def _all_steps(url: str, steps: int):
    from tests.helpers.jobs import scrape, value

    samples = scrape(url)
    done = all(value(samples, "rankscope_steps_total", rank=r) == steps for r in ("0", "1"))
    return samples if done else None
