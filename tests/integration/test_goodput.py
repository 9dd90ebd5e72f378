"""Goodput: where each rank process's wall time goes (rankscope.step.goodput), in a real job
with checkpoints, a crash and a relaunch from the checkpoint, and in one process."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from prometheus_client.multiprocess import MultiProcessCollector

from rankscope import Monitor
from rankscope.contract.catalog import GOODPUT_CATEGORIES
from rankscope.contract.rundir import load_registrations
from rankscope.step.goodput import TimeUse
from tests.helpers.jobs import TrainJob

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT",
               "TORCHELASTIC_RUN_ID")


def samples(run_dir: Path) -> list:
    return [s for family in MultiProcessCollector.merge([str(p) for p in run_dir.glob("*.db")], accumulate=True)
            for s in family.samples]


def wall_seconds(run_dir: Path) -> dict[str, dict[str, float]]:
    """rank -> category -> seconds, summed over every process of the rank, from the files."""
    out: dict[str, dict[str, float]] = {}
    for s in samples(run_dir):
        if s.name == "rankscope_wall_seconds_total":
            out.setdefault(s.labels["rank"], {})[s.labels["category"]] = s.value
    return out


# -- the attribution itself ------------------------------------------------------------

def test_time_is_split_without_gap_or_overlap():
    use = TimeUse(process_start=100.0, repeated_through=4)
    use.interval("checkpoint_restore", 101.0, 103.0)           # before the first step: not start-up
    use.step(3, True, 104.0, 106.0, data=0.5)                   # a repeat of an earlier launch's step
    use.step(5, True, 106.0, 108.0, data=0.0)
    use.interval("evaluation", 108.5, 109.5)
    use.interval("checkpoint_save", 110.2, 110.7)               # inside the next step
    use.step(6, True, 110.0, 112.0, data=0.2)
    use.failed_step(112.0, 113.0)
    use.until(115.0)
    s = use.take()
    assert s == pytest.approx({"startup": 2.0, "checkpoint_restore": 2.0, "data_wait": 0.7, "lost_progress": 1.5,
                               "productive": 2.0 + 1.3, "evaluation": 1.0, "checkpoint_save": 0.5,
                               "idle": 0.5 + 0.5 + 1.0 + 2.0})
    assert sum(s.values()) == pytest.approx(115.0 - 100.0)
    assert use.highest_step == 6
    assert use.take() == dict.fromkeys(GOODPUT_CATEGORIES, 0.0)


def test_a_publish_during_a_step_never_counts_its_time_twice():
    use = TimeUse(process_start=0.0, repeated_through=-1)
    use.step(0, False, 1.0, 2.0, data=0.0)
    use.until(2.5)                          # a publish while the next fetch had not begun
    use.step(1, False, 2.2, 3.0, data=0.3)   # ...which started before that publish's "now"
    s = use.take()
    assert sum(s.values()) == pytest.approx(3.0)
    assert s["startup"] == 1.0 and s["idle"] == pytest.approx(0.5)


def test_a_hung_step_is_idle_as_it_passes_and_only_its_rest_counts_if_it_ends():
    use = TimeUse(process_start=0.0, repeated_through=-1)
    use.step(0, False, 1.0, 2.0, data=0.0)
    use.hung(3.0, 50.0)                       # open since 3.0; a publish at 50.0 finds it hung
    use.hung(3.0, 80.0)
    use.step(1, False, 3.0, 81.0, data=0.5)   # it ended after all
    s = use.take()
    assert s == pytest.approx({**dict.fromkeys(GOODPUT_CATEGORIES, 0.0), "startup": 1.0, "productive": 1.0 + 0.5,
                               "idle": 1.0 + 77.0, "data_wait": 0.5})
    assert sum(s.values()) == pytest.approx(81.0)


# -- one process, through the Monitor API ---------------------------------------------

def test_categories_of_a_monitored_loop_add_up_to_its_wall_time(tmp_path, monkeypatch):
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    m = Monitor(exporter="off", metrics_dir=tmp_path, run="goodput", publish_interval_s=0.2)
    try:
        def slow_batches():
            while True:
                time.sleep(0.05)
                yield 1
        batches = m.data(slow_batches())
        with m.checkpoint("restore"):
            time.sleep(0.1)
        for i in range(10):
            next(batches)
            with m.step(step=i):
                time.sleep(0.02)
            if i == 4:
                with m.evaluation():
                    time.sleep(0.1)
        with m.checkpoint("save"):
            time.sleep(0.1)
        with pytest.raises(ValueError):
            with m.checkpoint("snapshot"):
                pass
    finally:
        m.close()
    reg = load_registrations(m.run_dir)[0]
    started = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME) + reg.pid_start_ticks / os.sysconf("SC_CLK_TCK")
    wall = reg.finished_at - started
    s = wall_seconds(m.run_dir)["0"]
    assert sum(s.values()) == pytest.approx(wall, abs=0.05)
    # Sleeps take at least what they ask; a loaded machine adds to them, never takes away.
    for category, slept in (("checkpoint_restore", 0.1), ("checkpoint_save", 0.1), ("evaluation", 0.1),
                            ("data_wait", 0.5), ("productive", 0.2)):
        assert slept <= s[category] < slept * 1.5 + 0.05, (category, s)
    assert s["lost_progress"] == 0 and s["startup"] > 0
    # Each batch's wait is in the data-wait histogram (10 batches of >= 50 ms).
    waits = {x.labels.get("le"): x.value for x in samples(m.run_dir) if x.name.startswith("rankscope_data_wait_seconds")}
    assert waits["0.025"] == 0 and waits["+Inf"] == 10
    # No FLOPs figure was given and there is no GPU: no MFU series at all, not a 0.
    names = {x.name for x in samples(m.run_dir)}
    assert "rankscope_model_flops_total" not in names and "rankscope_device_peak_flops" not in names


def test_a_hung_step_counts_as_idle_while_it_hangs(tmp_path, monkeypatch):
    from rankscope.step import goodput

    monkeypatch.setattr(goodput, "HUNG_AFTER_S", 0.3)
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    m = Monitor(exporter="off", metrics_dir=tmp_path, run="hung", publish_interval_s=0.1)
    try:
        for i in range(20):
            with m.step(step=i):
                time.sleep(0.005)
        with m.step(step=20):
            time.sleep(1.0)                      # far beyond 0.3 s and 10 medians: hung
            m.parts.publisher.flush()
            during = wall_seconds(m.run_dir)["0"]
    finally:
        m.close()
    assert during["idle"] >= 0.6, during         # counted while the step was still open
    assert during["productive"] < 0.2, during
    after = wall_seconds(m.run_dir)["0"]
    assert after["productive"] < 0.5, after       # the hang's first ~0.7 s stayed idle when it ended


# -- a real job: checkpoints, a crash, a relaunch from the checkpoint --------------------

def test_a_relaunch_counts_its_repeated_steps_as_lost_progress(tmp_path):
    """Launch 1 checkpoints every 20 steps and dies on an exception in step 50; launch 2
    resumes from step 40, so it repeats steps 40-49. Each step sleeps 0.1 s (+-0), so
    the steps' time is known without rankscope."""
    metrics_dir, checkpoints = tmp_path / "metrics", tmp_path / "ckpt"
    common = ["--step-delay", "0.1", "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "20",
              "--checkpoint-pause", "0.3", "--eval-every", "1000", "--workers", "0"]
    run_id = "goodput-relaunch"
    launches = []   # (seconds per rank, registrations): a new launch removes the last one's files
    for extra, ok in ((["--raise-at", "50", "--all-ranks"], False), (["--resume"], True)):
        with TrainJob(nproc=2, steps=70, metrics_dir=metrics_dir, run_id=run_id, extra_args=common + extra) as job:
            assert (job.wait(timeout=180) == 0) == ok, job.log()[-3000:]
            run_dir = next(metrics_dir.glob(f"{run_id}*"))
            launches.append((wall_seconds(run_dir), load_registrations(run_dir)))
    boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    tick = os.sysconf("SC_CLK_TCK")
    for rank in ("0", "1"):
        wall, s = 0.0, dict.fromkeys(GOODPUT_CATEGORIES, 0.0)
        for seconds, regs in launches:
            (reg,) = [r for r in regs if str(r.rank) == rank]
            wall += (reg.finished_at or reg.failed_at) - (boot + reg.pid_start_ticks / tick)
            for k, v in seconds[rank].items():
                s[k] += v
        total = sum(s.values())
        print(f"rank {rank}: wall {wall:.2f} s, categories {total:.2f} s: "
              + ", ".join(f"{k} {v:.2f}" for k, v in s.items()))
        assert total == pytest.approx(wall, rel=0.02), "the categories add up to the processes' wall time"
        # Steps 40-49 were done twice: their second run is lost progress, the others productive.
        per_step = (s["productive"] + s["lost_progress"]) / (50 + 30)
        assert s["lost_progress"] == pytest.approx(10 * per_step, rel=0.10)
        assert s["lost_progress"] == pytest.approx(10 * 0.1, rel=0.25), "10 steps of a 0.1 s sleep and a little compute"
        assert s["checkpoint_save"] >= 0.3 * 3, "saves at steps 20, 40 and 60, 0.3 s each"
        assert s["checkpoint_restore"] > 0 and s["startup"] > 0
