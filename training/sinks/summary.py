"""The common summary: successive reads of every rank's series turned into one record of
job-wide figures per interval, at the highest training step any rank has reached. Pure: no
I/O, no threads (tested on its own). The figures are ``rankscope.pages.figures``', the
rules' own (docs/sinks.md lists the tags).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Mapping

from rankscope import pages
from rankscope.contract.states import STALLED_STATES
from rankscope.pages.figures import (comm_share, compute_per_step, delta, deltas, finite, goodput, pooled, slowest,
                                     stalled)
from rankscope.pages.record import RankRecord

TAG = "rankscope/"
# The series the summary reads: only these lines of a page are parsed.
WANTED = frozenset({
    "rankscope_steps_total", "rankscope_step_duration_seconds_sum", "rankscope_step_duration_seconds_count",
    "rankscope_phase_seconds_total", "rankscope_loss", "rankscope_step", "rankscope_nonfinite_total",
    "rankscope_oom_total", "rankscope_rank_start_timestamp_seconds", "rankscope_rank_info", "rankscope_rank_state",
    "rankscope_hang_suspect", "rankscope_model_flops_total", "rankscope_device_peak_flops",
    "rankscope_wall_seconds_total", "rankscope_last_step_timestamp_seconds", "rankscope_rank_layout_info",
})
RankValues = RankRecord   # its name here before the record was shared with the console


def parse_page(text: str, run: str) -> dict[int, RankRecord]:
    """Every rank of ``run`` in an exporter page (only the lines of the series used here are parsed)."""
    return pages.run_records(pages.parse(text, WANTED, run), run)


@dataclass
class Record:
    """One interval's figures: scalars by tag, and event lines, at ``step``."""

    step: int
    scalars: dict[str, float]
    events: list[str]
    wall_time: float


class Summarizer:
    """Turns successive scrapes into records."""

    def __init__(self) -> None:
        self.prev: dict[int, RankRecord] | None = None
        self.last_step: int | None = None
        self.last_states: dict[str, float] = {}

    def update(self, ranks: Mapping[int, RankRecord]) -> Record | None:
        """The record of the interval since the previous call; None for the first call, and for an
        interval with nothing new (no step, no event)."""
        prev = self.prev
        self.prev = dict(ranks)
        if prev is None or not ranks:
            return None
        steps = [r.step for r in ranks.values() if finite(r.step)]
        step = int(max(steps)) if steps else 0
        scalars: dict[str, float] = {}
        events: list[str] = []
        step_means: dict[int, float] = {}
        compute: dict[int, float] = {}
        phase_seconds: dict[int, dict[str, float]] = {}
        rates: list[float] = []
        mfu: list[float] = []
        walls: list[dict[str, float]] = []
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
            d_nonfinite = delta(r.nonfinite, p.nonfinite) or 0.0
            d_oom = delta(r.oom, p.oom) or 0.0
            if d_nonfinite:
                nonfinite += int(d_nonfinite)
                events.append(f"rank {rank}: {int(d_nonfinite)} step(s) with a non-finite loss or gradient norm")
            if d_oom:
                oom += int(d_oom)
                events.append(f"rank {rank}: {int(d_oom)} out-of-memory error(s)")
            d_steps = delta(r.steps, p.steps)
            d_sum, d_count = delta(r.dur_sum, p.dur_sum), delta(r.dur_count, p.dur_count)
            if d_sum is not None and d_count:
                step_means[rank] = d_sum / d_count
            d_phases = deltas(r.phases, p.phases)
            if sum(d_phases.values()) > 0:
                phase_seconds[rank] = d_phases
            # Compute per step as the straggler rule reads it (its phases' increase over its steps'). A
            # scrape between the publisher's writes of the step counter and of the phases (a CUDA step's
            # phases arrive a publish after it) moves those steps' compute into the next interval, as
            # it moves it into the rule's next rate window.
            per_step = compute_per_step(d_phases, d_steps)
            if per_step is not None:
                compute[rank] = per_step
            # Rates over the rank's own clock (its last steps' completion times), not over the scrapes'
            # (the values reach the exporter up to a publish interval late).
            span = r.step_ts - p.step_ts if finite(r.step_ts) and finite(p.step_ts) else 0.0
            if d_steps and span > 0:
                rates.append(d_steps / span)
            d_flops = delta(r.flops, p.flops)
            if d_flops is not None and finite(r.peak_flops) and r.peak_flops > 0 and span > 0:
                mfu.append(d_flops / span / r.peak_flops)
            if r.wall and p.wall:
                d_wall = deltas(r.wall, p.wall)
                if sum(d_wall.values()) > 0:
                    walls.append(d_wall)
        if step_means:
            values = list(step_means.values())
            scalars[TAG + "step_time/min"] = min(values)
            scalars[TAG + "step_time/median"] = statistics.median(values)
            scalars[TAG + "step_time/max"] = max(values)
        found = slowest(compute, {k: ranks[k].stage for k in compute})
        if found is not None:
            scalars[TAG + "slowest_rank"] = float(found[0])
            if found[1] is not None:
                scalars[TAG + "straggler_ratio"] = found[1]
        shares = [s for s in map(comm_share, phase_seconds.values()) if s is not None]
        if shares:
            scalars[TAG + "comm_wait_fraction"] = comm_share(pooled(phase_seconds.values()))
            scalars[TAG + "comm_wait_fraction/max"] = max(shares)
        losses = [r.loss for r in ranks.values() if finite(r.loss)]
        if losses:
            scalars[TAG + "loss/mean"] = statistics.fmean(losses)
            scalars[TAG + "loss/spread"] = max(losses) - min(losses)
            scalars[TAG + "loss/std"] = statistics.pstdev(losses)
        if rates:
            scalars[TAG + "throughput/steps_per_s"] = statistics.fmean(rates)
        if mfu:
            scalars[TAG + "mfu"] = statistics.fmean(mfu)
        if walls:
            scalars[TAG + "goodput"] = goodput(pooled(walls))
        # Rank states: counted every record; each rank that turns stalled, dead or suspect is an event.
        dead = [k for k, r in ranks.items() if r.state == "dead"]
        suspects = [k for k, r in ranks.items() if r.hang_suspect]
        for k in sorted(ranks):
            p = prev.get(k)
            if ranks[k].state in STALLED_STATES + ("dead",) and (p is None or p.state != ranks[k].state):
                events.append(f"rank {k} is {ranks[k].state}")
            if ranks[k].hang_suspect and (p is None or not p.hang_suspect):
                events.append(f"rank {k} is the hang suspect (outside the collective its peers wait in)")
        states = {TAG + "ranks/reporting": float(len(ranks)),
                  TAG + "ranks/stalled": float(len(stalled({k: r.state for k, r in ranks.items()}))),
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
