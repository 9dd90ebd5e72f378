"""Unit tests of the rank side's pure parts and the exporter's state logic."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rankscope.exporter.config import ExporterConfig
from rankscope.exporter.ranks import RankView, derive_states
from rankscope.collectives.tracker import CollectiveTracker
from rankscope.device.rank_device import RankDevice
from tests.helpers.strict_cuda import StrictCuda, in_thread
from rankscope.config import ConfigError, MonitorConfig
from rankscope.step.judging import GradNormTracker, LossTracker
from rankscope.identity import RankIdentity
from rankscope.contract.rundir import (Registration, db_file_pid, latest_per_rank, load_registrations,
                                   process_start_ticks, remove_previous_launch, run_slug)

# -- configuration ---------------------------------------------------------------


def test_config_from_env_and_overrides(tmp_path):
    env = {"RANKSCOPE_METRICS_PORT": "9500", "RANKSCOPE_SPIKE_ZSCORE": "4.5", "RANKSCOPE_METRICS_DIR": str(tmp_path)}
    cfg = MonitorConfig.from_env(env, metrics_port=9600)
    assert cfg.metrics_port == 9600 and cfg.spike_zscore == 4.5 and cfg.metrics_dir == tmp_path


@pytest.mark.parametrize("env, option", [
    ({"RANKSCOPE_METRICS_PORT": "abc"}, "RANKSCOPE_METRICS_PORT"),
    ({"RANKSCOPE_METRICS_PORT": "70000"}, "metrics_port"),
    ({"RANKSCOPE_EXPORTER": "sometimes"}, "exporter"),
    ({"RANKSCOPE_COMM_TIMING": "magic"}, "comm_timing"),
    ({"RANKSCOPE_PUBLISH_INTERVAL_S": "0"}, "publish_interval_s"),
    ({"RANKSCOPE_LOSS_WINDOW": "1"}, "loss_window"),
])
def test_bad_config_names_the_option(env, option):
    with pytest.raises(ConfigError, match=option):
        MonitorConfig.from_env(env)


def test_unknown_option_and_file_as_directory(tmp_path):
    with pytest.raises(ConfigError, match="unknown option"):
        MonitorConfig.from_env({}, metrics_prot=1)
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(ConfigError, match="metrics_dir"):
        MonitorConfig.from_env({"RANKSCOPE_METRICS_DIR": str(f)})


def test_identity_from_torchrun_slurm_and_defaults():
    ident = RankIdentity.from_env(env={"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                                       "TORCHELASTIC_RUN_ID": "abc", "RANKSCOPE_NODE": "n7"})
    assert ident.labels == {"run": "abc", "rank": "3", "local_rank": "1", "node": "n7"}
    slurm = RankIdentity.from_env(env={"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                                       "SLURM_NTASKS_PER_NODE": "8", "SLURM_JOB_ID": "4242",
                                       "SLURMD_NODENAME": "gpu17"})
    assert (slurm.run, slurm.rank, slurm.node, slurm.slurm_job_id) == ("4242", 5, "gpu17", "4242")
    assert RankIdentity.from_env(env={}).run == "default"
    # torchrun --master-addr/--master-port (static rendezvous: its run id is "none"): the endpoint
    static = {"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "10.0.0.7",
              "MASTER_PORT": "29511"}
    assert RankIdentity.from_env(env=static).run == "10.0.0.7:29511"
    assert RankIdentity.from_env(env=static | {"SLURM_JOB_ID": "4242"}).run == "4242"        # the scheduler's id
    assert RankIdentity.from_env(env=static | {"JOB_NAME": "llama-pretrain"}).run == "llama-pretrain"
    assert RankIdentity.from_env(env=static | {"TORCHELASTIC_RUN_ID": "rdzv-9"}).run == "rdzv-9"
    assert RankIdentity.from_env(env=static | {"RANKSCOPE_RUN": "mine"}).run == "mine"
    with pytest.raises(ConfigError, match="RANK"):
        RankIdentity.from_env(env={"RANK": "x"})
    with pytest.raises(ConfigError, match="outside WORLD_SIZE"):
        RankIdentity.from_env(env={"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(ConfigError, match="RANK=3 is set but WORLD_SIZE is not"):   # a half-set launcher environment
        RankIdentity.from_env(env={"RANK": "3", "LOCAL_RANK": "3"})
    assert RankIdentity.from_env(env={"RANK": "0"}).world_size == 1                    # rank 0 alone: a 1-rank job


def test_a_second_live_job_on_a_run_id_in_use_is_caught(tmp_path, caplog):
    """Two jobs that land on one run id on one node would add their counts up: a live process
    registered as this rank, launched by another launcher, is another job, caught at start-up.
    A single-process job takes a run id of its own; a distributed one is refused, naming the
    other job. Another rank of the same run is not another job, whatever launched it (srun,
    mp.spawn and Lightning start each rank as its own process)."""
    from rankscope.contract.rundir import Registration, process_start_ticks, run_slug
    from rankscope.publishing.startup import claim_run

    other = subprocess.Popen(["sleep", "60"])
    try:
        ticks = process_start_ticks(other.pid)
        run_dir = tmp_path / run_slug("shared")
        Registration(run="shared", rank=0, local_rank=0, node="n1", world_size=2, local_world_size=2,
                     pid=other.pid, pid_start_ticks=ticks, agent_pid=other.pid, agent_start_ticks=ticks,
                     started_at=time.time()).save(run_dir)
        alone = RankIdentity.from_env(env={"RANKSCOPE_RUN": "shared"})
        with caplog.at_level("WARNING", logger="rankscope"):
            own = claim_run(alone, tmp_path)
        assert own.run == f"shared-{os.getpid()}" and f"pid {other.pid}" in caplog.text
        distributed = RankIdentity.from_env(env={"RANKSCOPE_RUN": "shared", "RANK": "0", "WORLD_SIZE": "2"})
        with pytest.raises(ConfigError, match=rf"run 'shared' on node .* still running \(its rank 0 is pid "
                                              rf"{other.pid}.*RANKSCOPE_RUN"):
            claim_run(distributed, tmp_path)
        peer = RankIdentity.from_env(env={"RANKSCOPE_RUN": "shared", "RANK": "1", "WORLD_SIZE": "2"})
        assert claim_run(peer, tmp_path).run == "shared"   # the same job's other rank
        assert claim_run(RankIdentity.from_env(env={"RANKSCOPE_RUN": "another"}), tmp_path).run == "another"
    finally:
        other.kill()
        other.wait()
    assert claim_run(distributed, tmp_path).run == "shared"   # its job is gone: a relaunch, not a clash


# -- divergence detection ----------------------------------------------------------


def test_loss_tracker_flags_spikes_and_nonfinite_exactly():
    t = LossTracker(window=50, ema_alpha=0.1, spike_z=6.0, warmup=20)
    for i in range(100):
        v = t.observe(2.0 + 0.01 * math.sin(i))
        assert not v.spike and not v.nonfinite
    assert t.observe(float("nan")).nonfinite
    assert t.observe(float("inf")).nonfinite
    spike = t.observe(5.0)
    assert spike.spike and spike.zscore > 6
    assert not t.observe(2.0).spike  # one spike does not poison the window


def test_loss_tracker_respects_warmup_and_flat_loss():
    t = LossTracker(window=10, ema_alpha=0.1, spike_z=6.0, warmup=5)
    t.observe(1.0)
    t.observe(1.0)
    assert not t.observe(100.0).spike        # before warm-up
    flat = LossTracker(window=10, ema_alpha=0.1, spike_z=6.0, warmup=2)
    for _ in range(20):
        assert not flat.observe(1.0).spike   # a flat loss never spikes on float noise


def test_grad_norm_tracker():
    g = GradNormTracker(factor=10.0, warmup=5)
    for _ in range(20):
        assert g.observe(1.0) == (False, False)
    assert g.observe(50.0) == (False, True)
    assert g.observe(float("nan")) == (True, False)
    assert g.avg < 2.0


# -- registration and cleaning ---------------------------------------------------


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


# -- rank states -----------------------------------------------------------------


def _view(rank: int, alive=True, heartbeat=0.0, last_step=0.0, in_flight=None, finished=None, started=0.0):
    reg = Registration(run="r", rank=rank, local_rank=rank, node="n", world_size=3, local_world_size=3,
                       pid=os.getpid(), pid_start_ticks=None, agent_pid=1, agent_start_ticks=None,
                       started_at=started, finished_at=finished)
    return RankView(reg=reg, alive=alive, heartbeat=heartbeat, last_step=last_step, in_flight=in_flight or {})


def test_states_and_hang_suspect(tmp_path):
    cfg = ExporterConfig(directory=tmp_path, stuck_after_s=30, frozen_after_s=10, suspect_after_s=10)
    now = time.time()
    waiting = [_view(r, heartbeat=now, last_step=now - 40, in_flight={"all_reduce": now - 38}) for r in (0, 1)]
    culprit = _view(2, heartbeat=now, last_step=now - 40)
    frozen = _view(3, heartbeat=now - 20, last_step=now - 1)
    fine = _view(4, heartbeat=now, last_step=now - 1)
    dead = _view(5, alive=False, last_step=now - 100)
    done = _view(6, alive=False, finished=now, last_step=now - 5)
    starting = _view(7, heartbeat=now, started=now - 2)
    views = waiting + [culprit, frozen, fine, dead, done, starting]
    derive_states(views, cfg, now)
    assert [v.state for v in views] == ["stuck_in_collective", "stuck_in_collective", "stuck", "frozen",
                                        "progressing", "dead", "finished", "starting"]
    assert [v.rank for v in (x.reg for x in views if x.suspect)] == [2]


def test_a_rank_that_ended_on_an_exception_is_dead_and_names_it(tmp_path):
    """Even while its process is still on its way out, a failed rank is not
    finished (no alert) nor progressing: it is dead, and its exception is exported."""
    from rankscope.exporter.ranks import _add_view, _derived_families

    cfg = ExporterConfig(directory=tmp_path)
    now = time.time()
    failed = _view(0, heartbeat=now, last_step=now - 1)
    failed.reg.end(now, "OutOfMemoryError")
    clean = _view(1, alive=False, last_step=now - 1)
    clean.reg.end(now, "")
    derive_states([failed, clean], cfg, now)
    assert (failed.state, clean.state) == ("dead", "finished")
    families = _derived_families()
    for v in (failed, clean):
        _add_view(families, v, now)
    info = families["rankscope_rank_failure_info"].samples
    assert [(s.labels["rank"], s.labels["exception"], s.value) for s in info] == [("0", "OutOfMemoryError", 1.0)]


def test_long_steps_are_not_hangs_but_a_hang_in_them_is_found_within_three_steps(tmp_path):
    """A job whose steps take 45 s: 40 s after its last step a rank is in its next step (not
    stuck, not a suspect while its peers sit in a long backward); 3 steps' time later it is."""
    from rankscope.exporter.ranks import RecentStepTimes

    cfg = ExporterConfig(directory=tmp_path, stuck_after_s=30, suspect_after_s=10)
    now = time.time()
    times = RecentStepTimes()

    def rank(r: int, stalled: float, in_flight: bool, step_time: float = 45.0):
        v = _view(r, heartbeat=now, last_step=now - stalled,
                  in_flight={"all_reduce": now - stalled + 5} if in_flight else None)
        for k in range(5):   # the exporter saw its last steps end, one per step
            v.step_time = times.longest(tmp_path, v.reg, now - stalled - 45 * k, step_time - k)
        return v

    between = [rank(0, 40, True), rank(1, 40, False)]
    derive_states(between, cfg, now)
    assert [v.state for v in between] == ["progressing", "progressing"] and not any(v.suspect for v in between)
    hung = [rank(2, 140, True), rank(3, 140, False)]
    derive_states(hung, cfg, now)
    assert [v.state for v in hung] == ["stuck_in_collective", "stuck"] and hung[1].suspect
    # Before its first step, a rank's pace is unknown: 40 s into a first 45 s step it is starting;
    # stuck only where its peers wait for it (a start-up hang), or it waits inside a collective.
    first = [_view(5, heartbeat=now, started=now - 40), _view(6, heartbeat=now, started=now - 40)]
    derive_states(first, cfg, now)
    assert [v.state for v in first] == ["starting", "starting"] and not any(v.suspect for v in first)
    # A first compile may keep one rank far longer than its peer, who waits for it in the first
    # collective: not a suspect until the peer has waited first_step_suspect_after_s (120 s).
    compiling = [_view(7, heartbeat=now, started=now - 40), _view(8, heartbeat=now, started=now - 40,
                                                                  in_flight={"broadcast": now - 35})]
    derive_states(compiling, cfg, now)
    assert [v.state for v in compiling] == ["starting", "stuck_in_collective"] and not compiling[0].suspect
    # A first step of 45 s reaches its backward's all-reduce (in flight for a moment) 45 s after the
    # start: not stuck (the fault matrix's long-steps job read so once in ~700 polls).
    backward = [_view(9, heartbeat=now, started=now - 46, in_flight={"all_reduce": now - 0.01})]
    derive_states(backward, cfg, now)
    assert backward[0].state == "starting" and not backward[0].suspect
    at_start = [_view(7, heartbeat=now, started=now - 140), _view(8, heartbeat=now, started=now - 140,
                                                                  in_flight={"broadcast": now - 125})]
    derive_states(at_start, cfg, now)
    assert [v.state for v in at_start] == ["stuck", "stuck_in_collective"] and at_start[0].suspect
    short = [rank(4, 40, False, step_time=0.05)]   # a fast job keeps today's 30 s
    derive_states(short, cfg, now)
    assert short[0].state == "stuck"
    times.forget_except([])
    assert times.longest(tmp_path, short[0].reg, 0.0, 0.0) == 0.0


def test_a_rank_in_its_own_checkpoint_is_busy_and_its_waiting_peers_are_not_stuck(tmp_path):
    """Rank 0 saves inside monitor.checkpoint() for two minutes, its heartbeat a minute old (the
    save holds the GIL); rank 1 waits for it in a barrier: busy and progressing, no suspect. Past
    5 minutes without a heartbeat the saving rank is frozen; out of the block, the same picture is
    a hang with rank 0 its suspect."""
    cfg = ExporterConfig(directory=tmp_path, stuck_after_s=30, frozen_after_s=10, suspect_after_s=10)
    now = time.time()

    def picture(block_since: float, heartbeat_age: float) -> list:
        saving = _view(0, heartbeat=now - heartbeat_age, last_step=now - 121)
        saving.block_since = block_since
        waiting = _view(1, heartbeat=now, last_step=now - 121, in_flight={"barrier": now - 120})
        derive_states([saving, waiting], cfg, now)
        return [(v.state, v.suspect) for v in (saving, waiting)]

    assert picture(now - 120, 60) == [("busy", False), ("progressing", False)]
    # ... also where its barrier is not counted as a collective (outside any, as far as rankscope knows)
    saving = _view(0, heartbeat=now, last_step=now - 121)
    saving.block_since = now - 120
    waiting = _view(1, heartbeat=now, last_step=now - 121)
    derive_states([saving, waiting], cfg, now)
    assert [(v.state, v.suspect) for v in (saving, waiting)] == [("busy", False), ("progressing", False)]
    assert picture(now - 120, 400) == [("frozen", True), ("stuck_in_collective", False)]
    # The moment after the save: its block gone from rank 0's files, the peer's 2-minute wait not yet
    # (its publisher writes every half second). The block's end is progress, for the rank that
    # waited for it too: no stall, no suspect, nothing for the evidence keeper to capture.
    saved = _view(0, heartbeat=now, last_step=now - 121)
    saved.block_ended = now - 0.3
    still_waiting = _view(1, heartbeat=now, last_step=now - 121, in_flight={"barrier": now - 120})
    derive_states([saved, still_waiting], cfg, now)
    assert [(v.state, v.suspect) for v in (saved, still_waiting)] == [("progressing", False),
                                                                      ("progressing", False)]
    assert picture(0.0, 0.5) == [("stuck", True), ("stuck_in_collective", False)]


def test_no_suspect_while_collectives_are_short(tmp_path):
    cfg = ExporterConfig(directory=tmp_path)
    now = time.time()
    views = [_view(0, heartbeat=now, last_step=now - 1, in_flight={"all_reduce": now - 0.5}),
             _view(1, heartbeat=now, last_step=now - 1)]
    derive_states(views, cfg, now)
    assert not any(v.suspect for v in views)


# -- collective bookkeeping (the CUDA-event path, with events that behave like CUDA's) --


def test_device_spans_are_read_lazily_in_order_and_events_reused():
    with StrictCuda(rank_device=0) as cuda:
        cuda.set_device(0)
        device = RankDevice(lambda what, reason: None)
        device.bind("cuda:0")
        tracker = CollectiveTracker(device)
        with cuda.hold():                                   # the device is still busy with both
            a = tracker.begin_device("all_reduce", 1024, bucket=0)
            tracker.end_device(a)
            b = tracker.begin_device("all_reduce", 2048, bucket=1)
            tracker.end_device(b)
        assert set(tracker.in_flight()) == {"all_reduce"}
        assert tracker.poll_device() == 0                  # nothing finished: nothing read, nothing waited for
        b.start_event.done = b.end_event.done = True
        assert tracker.poll_device() == 0                  # launch order: b waits behind a
        a.start_event.done = a.end_event.done = True
        assert tracker.poll_device() == 2
        records = tracker.drain()
        assert [(r.bucket, r.nbytes) for r in records] == [(0, 1024), (1, 2048)]
        assert all(r.duration >= 0 for r in records) and tracker.in_flight() == {}
        created = device.events.created
        c = tracker.begin_device("broadcast", 8)           # events come back from the pool
        assert device.events.created == created == 4 and c.start_event in (a.start_event, a.end_event,
                                                                            b.start_event, b.end_event)


def test_the_rank_device_is_learnt_once_and_kept_once_events_exist(caplog):
    """Monitor() without a device: the first CUDA model or value names it. A different device
    later is taken only while no event exists yet (a model on cuda:3 after cuda:2 was named):
    an event created on one device cannot be recorded on another's stream."""
    with StrictCuda(rank_device=3):
        device = RankDevice(lambda what, reason: None)
        assert not device.bind(None) and not device.cuda
        assert device.bind("cuda:2") and device.index == 2
        assert not device.bind("cuda:2")                                       # the same: nothing changes
        assert device.bind("cuda:3") and device.index == 3                     # no event yet
        event = device.events.get()
        event.record(device.stream())
        assert event.stream.index == 3
        with caplog.at_level("WARNING", logger="rankscope"):
            assert not device.bind("cuda:0")
            assert not device.bind("cuda:1")
        assert device.index == 3 and len([r for r in caplog.records if "not timed" in r.message]) == 1


def test_host_collectives_in_flight_and_bounded_buffer():
    tracker = CollectiveTracker(RankDevice(lambda what, reason: None))
    token, t0, start = tracker.begin("barrier")
    assert tracker.in_flight()["barrier"] == start
    tracker.end(token, "barrier", 0, t0, start)
    assert tracker.in_flight() == {}
    assert [r.op for r in tracker.drain()] == ["barrier"]
    for _ in range(tracker.completed.maxlen + 10):
        tracker.end(-1, "all_reduce", 4, time.perf_counter(), time.time())
    assert tracker.dropped == 10
    assert len(tracker.drain()) == tracker.completed.maxlen


def test_cuda_phases_come_from_events_read_later(tmp_path, monkeypatch):
    """The CUDA path of a step, with events that complete when the test says so."""
    from rankscope import monitor as monitor_module
    from rankscope.collectives.comm_timing import HookTiming

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with StrictCuda(rank_device=0) as cuda:
        cuda.set_device(0)
        monitor = monitor_module.Monitor(exporter="off", metrics_dir=tmp_path, run="cuda-path", backend="nccl",
                                         publish_interval_s=60, device="cuda:0")
        try:
            hook = HookTiming(monitor.parts.tracker, lambda: None)
            monitor.parts.watched.use_comm_timing(hook)   # as watch() sets it
            with cuda.hold(), monitor.step(samples=4) as step:
                with step.phase("forward"):
                    time.sleep(0.01)
                with step.phase("backward"):
                    bucket = monitor.parts.tracker.begin_device("all_reduce", 4096, bucket=0)
                    hook.last_device_span = bucket
                    time.sleep(0.02)
                    monitor.parts.tracker.end_device(bucket)
            in_thread(monitor.parts.publisher.publish)
            phase = monitor.parts.metrics.phase
            assert phase["forward"]._value.get() == 0                 # nothing read before the GPU is done
            with monitor.parts.device.on_device():
                assert monitor.parts.device.reads.ready_steps() == []
            cuda.release()
            in_thread(monitor.parts.publisher.publish)
            assert not monitor.parts.device.reads._steps
            forward, backward, comm = (phase[p]._value.get() for p in ("forward", "backward", "comm_wait"))
            assert forward >= 0.01
            assert comm == pytest.approx(bucket.duration) and comm >= 0.02   # last bucket: the exposed wait
            assert backward >= 0 and backward + comm >= 0.02
            step_seconds = monitor.parts.metrics.step_duration._sum.get()
            assert sum(p._value.get() for p in phase.values()) == pytest.approx(step_seconds, rel=1e-6)
        finally:
            monitor.close()


def test_reducer_mode_without_ddp_timers_fails_at_watch(tmp_path, monkeypatch):
    """comm_timing=reducer reads DDP's private runtime-logging API: if a torch
    release drops it, watch() says so at start-up instead of failing mid-run."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from rankscope.monitor import Monitor

    class DdpWithoutTimers(DistributedDataParallel):   # a DDP whose private logging API is gone
        def __init__(self):
            torch.nn.Module.__init__(self)   # no process group needed: nothing is reduced here
            self.module = torch.nn.Linear(2, 2)
            self._comm_hooks = []

        def register_comm_hook(self, state, hook):
            raise AssertionError("reducer mode must not register a hook")

        def _get_ddp_logging_data(self):
            raise AttributeError("_get_ddp_logging_data")

        def _set_ddp_runtime_logging_sample_rate(self, rate):
            raise AttributeError("_set_ddp_runtime_logging_sample_rate")

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monitor = Monitor(exporter="off", metrics_dir=tmp_path, run="no-timers", publish_interval_s=60)
    try:
        with pytest.raises(ConfigError, match="comm_timing=reducer: cannot read DDP's timers.*use comm_timing=hook"):
            monitor.watch(DdpWithoutTimers())
        plain = torch.nn.Linear(2, 2)   # FSDP2, tensor parallel, ...: seen through the flight recorder
        assert monitor.watch(plain) is plain
        with pytest.raises(ConfigError, match="expected a torch.nn.Module"):
            monitor.watch(object())
    finally:
        monitor.close()


def test_reducer_timing_counts_a_long_backward_as_waiting_not_compute():
    """DDP's timers are read on 1 step in 10. A peer frozen for 30 s makes this
    rank's backward last 30 s on a step the last sample knows nothing of: that
    time is waiting (comm_wait), or the rank would look like a straggler."""
    from rankscope.collectives.comm_timing import ReducerTiming

    class SampledTimers:
        exposed = 0.002   # the last sample: 2 ms of exposed all-reduce
        compute = 0.0     # no sample of the compute yet: the clipped moving average stands in

    timing = ReducerTiming(CollectiveTracker(RankDevice(lambda what, reason: None)), on_error=lambda: None)
    timing.timers = SampledTimers()
    for _ in range(50):
        assert timing.exposed_wait(0.0, 0.012, 0.012) == pytest.approx(0.002)   # usual steps: the sample
    assert timing.exposed_wait(0.0, 30.0, 30.0) == pytest.approx(30.0 - 0.012, rel=1e-3)
    assert timing.usual_backward < 0.03                                        # the wait did not become usual
    assert timing.exposed_wait(0.0, 0.013, 0.013) == pytest.approx(0.002)


def test_reducer_timing_never_learns_a_fabric_wide_wait_as_compute():
    """A slow fabric slows every step's all-reduce: every backward is 30x its compute, on
    every rank and every step. The usual backward is DDP's sampled compute, so the wait stays
    a wait however long it lasts; a clipped moving average of the whole backward would learn
    it within a hundred steps and book it as every rank's compute."""
    from rankscope.collectives.comm_timing import ReducerTiming

    class SampledTimers:
        exposed = 0.29    # the sampled step waited 290 ms after its compute
        compute = 0.010   # and computed 10 ms

    timing = ReducerTiming(CollectiveTracker(RankDevice(lambda what, reason: None)), on_error=lambda: None)
    timing.timers = SampledTimers()
    for _ in range(1000):
        assert timing.exposed_wait(0.0, 0.30, 0.30) == pytest.approx(0.29)
    # The compute itself doubles (a slower GPU): DDP's samples say so, and it is compute.
    SampledTimers.exposed, SampledTimers.compute = 0.0, 0.020
    assert timing.exposed_wait(0.0, 0.021, 0.021) == pytest.approx(0.0)
    assert timing.usual_backward == pytest.approx(0.020)


def test_the_memory_limit_is_read_from_the_process_own_cgroup(tmp_path):
    """Under Slurm or systemd (cgroup v1, no namespace) the job's limit is in its
    own cgroup's directory; the mount's root file is the unlimited root cgroup."""
    from rankscope.device.memory import _cgroup_limit_files

    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/slurm/uid_1/job_7\n0::/user.slice\n")
    files = [str(p.relative_to(tmp_path)) for p in _cgroup_limit_files(str(proc), str(tmp_path))]
    assert files.index("memory/slurm/uid_1/job_7/memory.limit_in_bytes") < files.index(
        "memory/memory.limit_in_bytes")
    assert files[0] == "user.slice/memory.max"
