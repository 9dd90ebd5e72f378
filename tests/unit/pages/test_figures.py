"""The run figures (rankscope.pages.figures) mean what the alert rules mean: the straggler's peer
ratio is over the median of its stage WITHOUT the slowest, in Python and in the PromQL the report
falls back to, and both agree with the recorded rule (promtool, on the same series)."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest
import yaml

from rankscope.contract.catalog import PHASES
from rankscope.contract.thresholds import COMM_BOUND_RATIO, INPUT_BOUND_RATIO
from rankscope.pages import figures

ROOT = Path(__file__).resolve().parents[3]


def test_peer_ratio_leaves_the_slowest_out_of_its_baseline():
    # 2 ranks: the median of both is their mean, and a 1.5x rank would read 1.2; against its peer, 1.5.
    assert figures.peer_ratios({0: 0.02, 1: 0.03}) == pytest.approx({0: 1.0, 1: 1.5})
    # 3 ranks at 20, 30, 60 ms: 60 / median(20, 30) = 2.4 (the run's median, 30 ms, would say 2.0).
    assert figures.peer_ratios({0: 0.02, 1: 0.03, 2: 0.06})[2] == pytest.approx(2.4)
    assert figures.slowest({0: 0.02, 1: 0.03, 2: 0.06}) == (2, pytest.approx(2.4))
    # One rank: no peers, no ratio; the slowest is still known.
    assert figures.peer_ratios({"0": 0.02}) == {} and figures.slowest({"0": 0.02}) == ("0", None)
    # A rank without steps in the window (NaN) is left out, as the rule's `>= 0` leaves it out.
    assert set(figures.peer_ratios({0: 0.02, 1: math.nan, 2: 0.04})) == {0, 2}
    assert figures.slowest({}) is None


def test_peer_ratio_is_taken_within_each_stage():
    compute = {"0": 0.02, "1": 0.03, "2": 0.04, "3": 0.05, "4": 0.10}
    stages = {"0": "0", "1": "0", "2": "1", "3": "1", "4": "1"}
    ratios = figures.peer_ratios(compute, stages)
    assert ratios == pytest.approx({"0": 1.0, "1": 1.5, "2": 0.04 / 0.045, "3": 0.05 / 0.045, "4": 0.10 / 0.045})
    assert figures.slowest(compute, stages) == ("4", pytest.approx(0.10 / 0.045))


def test_compute_phase_shares_bounds_goodput_and_stalled():
    phases = {"data": 0.1, "forward": 0.2, "backward": 0.3, "optimizer": 0.1, "comm_wait": 0.3}
    assert figures.compute_seconds(phases) == pytest.approx(0.6)
    assert figures.compute_seconds({"data": 1.0}) is None
    assert figures.compute_per_step(phases, 10) == pytest.approx(0.06)
    assert figures.compute_per_step(phases, 0) is None
    shares = figures.phase_shares(phases)
    assert set(shares) == set(PHASES) and sum(shares.values()) == pytest.approx(1.0)
    assert figures.comm_share(phases) == pytest.approx(0.3) and figures.comm_share({}) is None
    assert figures.bound(phases) == ""
    assert figures.bound({"data": INPUT_BOUND_RATIO + 0.01, "forward": 1 - INPUT_BOUND_RATIO - 0.01}) == "input-bound"
    assert figures.bound({"comm_wait": COMM_BOUND_RATIO + 0.01, "forward": 1 - COMM_BOUND_RATIO - 0.01}) == \
        "comm-bound"
    assert figures.pooled([{"a": 1.0}, {"a": 2.0, "b": 1.0}]) == {"a": 3.0, "b": 1.0}
    assert figures.goodput({"productive": 3.0, "idle": 1.0}) == pytest.approx(0.75) and figures.goodput({}) is None
    assert figures.stalled({"1": "stuck", "0": "frozen", "2": "progressing", "3": None}) == ["0", "1"]
    assert figures.delta(5.0, 3.0) == 2.0 and figures.delta(2.0, 3.0) == 2.0 and figures.delta(None, 1.0) is None


# ---- the PromQL the report falls back to, against the recorded rule --------------------------------
RATES = {  # run -> rank -> (stage or None, forward + backward seconds per step)
    "staged": {"0": ("0", 0.02), "1": ("0", 0.03), "2": ("1", 0.04), "3": ("1", 0.05), "4": ("1", 0.10)},
    "flat": {"0": (None, 0.02), "1": (None, 0.03), "2": (None, 0.06)},
}
STEPS_PER_MIN = 60
SELECTOR = 'job="rankscope"'


def _round(v: float) -> float:
    return math.floor(v * 10000 + 0.5) / 10000   # PromQL's round(v, 0.0001)


def _labels(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def test_the_reports_fallback_and_the_python_figure_agree_with_the_recorded_rule(tmp_path):
    series, expected_record, expected_fallback = [], [], []
    for run, ranks in RATES.items():
        compute = {rank: c for rank, (_, c) in ranks.items()}
        stages = {rank: st for rank, (st, _) in ranks.items() if st is not None}
        ratios = figures.peer_ratios(compute, stages)
        for rank, (stage, c) in ranks.items():
            ident = {"job": "rankscope", "run": run, "rank": rank}
            per_min = c * STEPS_PER_MIN
            series += [
                {"series": "rankscope_phase_seconds_total" + _labels({**ident, "phase": "forward"}),
                 "values": f"0+{per_min / 2}x15"},
                {"series": "rankscope_phase_seconds_total" + _labels({**ident, "phase": "backward"}),
                 "values": f"0+{per_min / 2}x15"},
                {"series": "rankscope_phase_seconds_total" + _labels({**ident, "phase": "comm_wait"}),
                 "values": "0+30x15"},   # not compute: its peers' wait for a straggler
                {"series": "rankscope_steps_total" + _labels(ident), "values": f"0+{STEPS_PER_MIN}x15"}]
            out = dict(ident)
            if stage is not None:
                series.append({"series": "rankscope_rank_layout_info" + _labels(
                    {**ident, "stage": stage, "tp_group": "", "mesh": f"pp={stage}"}), "values": "1x15"})
                out["stage"] = stage
            value = _round(ratios[rank])
            expected_record.append({"labels": _labels(out), "value": value})
            expected_fallback.append({"labels": _labels(out), "value": value})
    test = {
        "rule_files": [str(ROOT / "prometheus" / "rules" / "recording.yml")],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": series,
            "promql_expr_test": [
                {"expr": f"round({figures.PEER_RATIO_RECORD}, 0.0001)", "eval_time": "10m",
                 "exp_samples": expected_record},
                {"expr": f"round({figures.peer_ratio_promql(SELECTOR, '2m')}, 0.0001)",
                 "eval_time": "10m", "exp_samples": expected_fallback},
            ],
        }],
    }
    path = tmp_path / "peer_ratio_test.yml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    out = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
