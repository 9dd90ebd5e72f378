"""The exporter's rank states (rankscope.exporter.ranks): alive, stalled, stuck or dead, the hang
suspect, long steps and checkpoints that are not hangs."""

from __future__ import annotations

import os
import time

from rankscope.contract.rundir import Registration
from rankscope.exporter.config import ExporterConfig
from rankscope.exporter.ranks import RankView, derive_states


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
