"""The console's pure parts (issue 18): the quantile it reads from buckets agrees with
Prometheus's rule, the window falls back to totals when no step completed, the phase bar
fills its cells, and times, durations and URLs parse as documented. No processes.
"""

from __future__ import annotations

import math

import pytest

from rankscope.console.report import parse_time, straggler_ranking
from rankscope.console.sources import Series, SourceError, exporter_url, local_exporter_url, parse_duration
from rankscope.contract.rundir import save_exporter_address
from rankscope.console.top import PHASE_BAR_WIDTH, Screen, phase_bar, render, rows_shown
from rankscope.console.view import build_view, choose_run
from rankscope.pages.figures import histogram_quantile


def test_histogram_quantile_interpolates_like_prometheus():
    # 10 observations: 4 in (0, 0.1], 4 in (0.1, 0.2], 2 above 0.4.
    buckets = {0.1: 4.0, 0.2: 8.0, 0.4: 8.0, math.inf: 10.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.125)   # 5th of 10: a quarter into (0.1, 0.2]
    assert histogram_quantile(0.2, buckets) == pytest.approx(0.05)
    assert histogram_quantile(0.95, buckets) == 0.4                   # in +Inf: its lower bound
    assert histogram_quantile(0.5, {0.1: 0.0, math.inf: 0.0}) is None
    assert histogram_quantile(0.5, {}) is None


def _rank(run, rank, *, steps, buckets, phases, state="progressing", suspect=0, step=None, in_flight=None):
    ident = {"run": run, "rank": str(rank), "local_rank": str(rank), "node": "n1"}
    out = [Series("rankscope_steps_total", ident, steps), Series("rankscope_step", ident, step or steps - 1),
           Series("rankscope_hang_suspect", ident, suspect), Series("rankscope_rank_up", ident, 1)]
    out += [Series("rankscope_rank_state", {**ident, "state": s}, 1.0 if s == state else 0.0)
            for s in ("progressing", "stuck_in_collective", "stuck")]
    out += [Series("rankscope_step_duration_seconds_bucket", {**ident, "le": str(le)}, c) for le, c in buckets.items()]
    out += [Series("rankscope_phase_seconds_total", {**ident, "phase": p}, v) for p, v in phases.items()]
    if in_flight:
        op, age = in_flight
        out += [Series("rankscope_collective_in_flight", {**ident, "op": op}, 1.0),
                Series("rankscope_collective_in_flight_seconds", {**ident, "op": op}, age)]
    return out


def test_window_rates_and_the_fallback_to_totals_when_a_rank_did_not_step():
    before = (_rank("r", 0, steps=10, buckets={0.1: 10, 0.2: 10, math.inf: 10}, phases={"forward": 1.0})
              + _rank("r", 1, steps=10, buckets={0.1: 10, 0.2: 10, math.inf: 10}, phases={"forward": 1.0}))
    now = (_rank("r", 0, steps=30, buckets={0.1: 10, 0.2: 30, math.inf: 30}, phases={"forward": 1.0, "backward": 2.0})
           + _rank("r", 1, steps=10, buckets={0.1: 10, 0.2: 10, math.inf: 10}, phases={"forward": 1.0}, state="stuck",
                   suspect=1))
    view = build_view("r", now, source="test", baseline=before, window_s=10.0)
    r0, r1 = view.rows
    assert view.steps_per_s == pytest.approx((2.0 + 0.0) / 2)
    assert not r0.since_start and r0.median_step_s == pytest.approx(0.15)   # the window's 20 steps, all in (0.1, 0.2]
    assert r0.phase_fractions["backward"] == pytest.approx(1.0)            # only backward grew in the window
    assert r1.since_start and r1.phase_fractions["forward"] == pytest.approx(1.0)
    assert r1.lag == 20 and r0.lag == 0 and view.leader_step == 29
    assert view.suspects == [1] and view.state_counts() == {"progressing": 1, "stuck": 1}


def test_a_rank_missing_from_the_baseline_counts_from_zero():
    now = _rank("r", 0, steps=30, buckets={0.1: 30, math.inf: 30}, phases={"forward": 3.0})
    view = build_view("r", now, source="test", baseline=[], window_s=30.0)
    assert view.steps_per_s == pytest.approx(1.0) and not view.rows[0].since_start


def test_collective_in_flight_and_sorting():
    now = (_rank("r", 0, steps=5, buckets={math.inf: 5}, phases={"comm_wait": 1.0}, state="stuck_in_collective",
                 in_flight=("all_reduce", 12.5))
           + _rank("r", 1, steps=5, buckets={math.inf: 5}, phases={"forward": 1.0}, state="stuck", suspect=1))
    view = build_view("r", now, source="test")
    assert view.rows[0].collective == "all_reduce" and view.rows[0].collective_age_s == 12.5
    assert view.rows[1].collective == ""
    screen = Screen()
    screen.press("c", view)
    assert [r.rank for r in rows_shown(view, screen)] == [0, 1]
    screen.press("n", view)
    assert screen.node == "n1"
    screen.press("n", view)
    assert screen.node is None
    assert screen.press("q", view) is False


def test_choose_run_prefers_a_live_run_and_names_the_runs_it_has():
    samples = (_rank("old", 0, steps=5, buckets={}, phases={}, state="stuck")
               + _rank("new", 0, steps=5, buckets={}, phases={}))
    samples = [s for s in samples if not (s.labels["run"] == "old" and s.name == "rankscope_rank_state")]
    assert choose_run(samples, None, "here") == "new"
    assert choose_run(samples, "old", "here") == "old"
    with pytest.raises(SourceError, match=r"run 'gone' not found at here \(runs there: new, old\)"):
        choose_run(samples, "gone", "here")


def test_phase_bar_fills_its_cells_by_largest_remainder():
    bar = phase_bar({"data": 0.1, "forward": 0.45, "backward": 0.3, "comm_wait": 0.15}, color=False)
    assert len(bar.plain) == PHASE_BAR_WIDTH
    assert bar.plain == "d" + "f" * 5 + "bbbb" + "cc"
    assert phase_bar({}, color=False).plain == "-"


def test_render_plain_has_every_column():
    now = _rank("r", 0, steps=5, buckets={0.1: 5, math.inf: 5}, phases={"forward": 1.0})
    from rich.console import Console
    import io

    out = io.StringIO()
    Console(file=out, width=200, no_color=True, color_system=None).print(
        render(build_view("r", now, source="test"), Screen(), color=False, live=False))
    text = out.getvalue()
    for column in ("rank", "node", "state", "step", "lag", "last", "median", "phases", "loss", "grad norm",
                   "memory", "collective", "age", "hang"):
        assert column in text
    assert "\x1b[" not in text


def test_straggler_ranking_orders_by_compute_over_the_median_of_its_peers():
    """As the Straggler rule compares them: over the median of the ranks WITHOUT the slowest (0.030
    and 0.032 here), not of all ranks, which holds the straggler itself (0.032)."""
    per_rank = {"0": {"forward": 0.010, "backward": 0.020, "comm_wait": 0.05},
                "1": {"forward": 0.060, "backward": 0.020},
                "2": {"forward": 0.012, "backward": 0.020}}
    ranking = straggler_ranking(per_rank, {"0": "a", "1": "a", "2": "b"})
    assert [r["rank"] for r in ranking] == [1, 2, 0]
    assert ranking[0]["excess_over_peers"] == pytest.approx(0.080 / 0.031 - 1)
    assert ranking[0]["peer_ratio"] == pytest.approx(0.080 / 0.031)
    assert ranking[2]["comm_wait_per_step_s"] == 0.05
    # A rank alone has no peers: no ratio (the rule records none), and it is still ranked.
    alone = straggler_ranking({"0": {"forward": 0.01}}, {})
    assert alone[0]["rank"] == 0 and alone[0]["peer_ratio"] is None and alone[0]["excess_over_peers"] is None


def test_times_durations_and_urls(tmp_path):
    now = 1_000_000.0
    assert parse_time("now", now) == now
    assert parse_time("now-2h", now) == now - 7200
    assert parse_time("1700000000", now) == 1700000000
    assert parse_time("2026-12-03T17:00:00Z", now) == parse_time("2026-12-03T17:00:00", now)
    with pytest.raises(SourceError, match="bad time"):
        parse_time("yesterday", now)
    assert parse_duration("1m30s") == 90 and parse_duration("7d") == 7 * 86400
    with pytest.raises(ValueError):
        parse_duration("7 days")
    assert exporter_url("node1:9400") == "http://node1:9400/metrics"
    assert exporter_url("https://node1:9400/") == "https://node1:9400/metrics"
    assert exporter_url("http://node1:9400/metrics") == "http://node1:9400/metrics"
    mine = {"RANKSCOPE_METRICS_DIR": str(tmp_path)}
    assert local_exporter_url(mine) == "http://127.0.0.1:9400/metrics"
    assert local_exporter_url({"RANKSCOPE_METRICS_PORT": "9555", "RANKSCOPE_METRICS_ADDR": "0.0.0.0"}) \
        == "http://127.0.0.1:9555/metrics"
    # Another user's exporter holds 9400: this user's said where it listens (a live pid: this one).
    save_exporter_address(tmp_path, "0.0.0.0", 41234)
    assert local_exporter_url(mine) == "http://127.0.0.1:41234/metrics"
    assert local_exporter_url(mine | {"RANKSCOPE_METRICS_PORT": "9555"}) == "http://127.0.0.1:9555/metrics"
    with pytest.raises(SourceError, match="RANKSCOPE_METRICS_PORT"):
        local_exporter_url({"RANKSCOPE_METRICS_PORT": "http"})


def test_a_pipeline_job_shows_each_rank_stage_and_ranks_it_within_its_stage():
    """Ranks of different stages do different work: top shows the stage, the report ranks a rank
    against its own stage's median (stage 1's ranks at 1.6x stage 0's are not stragglers)."""
    from rich.console import Console
    import io

    now = []
    for rank, stage in ((0, "0"), (1, "1")):
        now += _rank("r", rank, steps=5, buckets={0.1: 5, math.inf: 5}, phases={"forward": 1.0})
        ident = {"run": "r", "rank": str(rank), "local_rank": str(rank), "node": "n1"}
        now += [Series("rankscope_rank_layout_info", {**ident, "stage": "9", "tp_group": "", "mesh": "pp=9"}, 0.0),
                Series("rankscope_rank_layout_info", {**ident, "stage": stage, "tp_group": "", "mesh": f"pp={stage}"},
                       1.0)]
    view = build_view("r", now, source="test")
    assert [row.stage for row in view.rows] == ["0", "1"]   # the layout it has now, not one it had
    out = io.StringIO()
    Console(file=out, width=220, no_color=True, color_system=None).print(render(view, Screen(), color=False,
                                                                               live=False))
    assert "stage" in out.getvalue()
    per_rank = {"0": {"forward": 0.05}, "1": {"forward": 0.05}, "2": {"forward": 0.08}, "3": {"forward": 0.128}}
    ranking = straggler_ranking(per_rank, {}, {"0": "0", "1": "0", "2": "1", "3": "1"})
    assert ranking[0]["rank"] == 3 and ranking[0]["stage"] == "1"
    assert ranking[0]["excess_over_peers"] == pytest.approx(0.128 / 0.08 - 1)   # over its one peer, rank 2
    # 1.6x stage 0's ranks, and no straggler: it is its stage's peer median itself.
    assert {r["rank"]: r["excess_over_peers"] for r in ranking}[2] == pytest.approx(0.0)
