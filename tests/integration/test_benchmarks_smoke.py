"""Each benchmark script runs end to end with tiny parameters and prints its
table and a final JSON line of figures.

No timing is asserted (CI machines are shared and noisy); what is checked is
that the scripts still work against the current monitor and exporter, and
that the figures they print are the ones docs/performance.md quotes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "tests" / "benchmarks"


def run_benchmark(name: str, *args: str, timeout: float = 240) -> tuple[str, dict]:
    proc = subprocess.run([sys.executable, str(BENCH / name), "--quick", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    lines = proc.stdout.strip().splitlines()
    figures = json.loads(lines[-1])
    assert any(line.startswith("|---") or line.startswith("|-") for line in lines), f"{name} printed no table"
    assert figures["machine"]["nproc"] >= 1
    return proc.stdout, figures


def test_overhead_quick():
    # A narrow model keeps the smoke run to a few seconds of training.
    out, figures = run_benchmark("overhead.py", "--rounds", "12", "--hidden", "256")
    assert figures["benchmark"] == "overhead"
    for rank in ("0", "1"):
        for comparison in ("full_vs_bare", "hook_vs_bare", "hook_vs_full"):
            c = figures["ranks"][rank][comparison]
            assert c["pairs"] == 12
            assert c["ci_frac"][0] <= c["frac"] <= c["ci_frac"][1]
    assert figures["scrapes_ok"] >= 1, "the exporter was never scraped during the job"
    assert "full_vs_bare" in out


def test_api_cost_quick():
    _, figures = run_benchmark("api_cost.py")
    assert figures["benchmark"] == "api_cost"
    off, sampled = figures["tracing_off_every_step"], figures["tracing_on_sampled_step"]
    assert off["n"] == 3000 and off["p50_us"] > 0
    assert sampled["n"] == 300, "one step in ten is sampled when tracing is on"
    assert figures["spans_received"] > 0, "sampled steps reached the real OTLP receiver"
    real = figures["real_step"]
    assert real["pairs"] == 200 and real["bare_mean_ms"] > 0
    assert real["ci_us"][0] < real["ci_us"][1], "a real interval from 200 paired differences"


def test_exporter_scale_quick():
    _, figures = run_benchmark("exporter_scale.py", "--ranks", "2", "8")
    assert figures["benchmark"] == "exporter_scale"
    by_size = {r["ranks"]: r for r in figures["results"]}
    assert set(by_size) == {2, 8}
    for n, r in by_size.items():
        assert r["progressing"] == n, "every synthetic rank is live and progressing"
        assert r["rank_series"] == n * r["series_per_rank"]
    assert by_size[8]["series"] > by_size[2]["series"]


def test_accuracy_quick():
    _, figures = run_benchmark("accuracy.py", "--steps", "15", "--allreduces", "5", "--hidden", "256")
    assert figures["benchmark"] == "accuracy"
    for r in figures["ranks"]:
        assert r["rankscope_step_count"] == 15
        assert r["rankscope_allreduce_count"] == 5
        assert r["rankscope_step_mean_s"] == pytest.approx(r["trainer_step_mean_s"], rel=0.5)


def test_step_segments_quick():
    _, figures = run_benchmark("step_segments.py")
    assert figures["benchmark"] == "step_segments" and figures["pairs"] == 100
    assert set(figures["segments"]) >= {"step_enter", "step_exit", "whole_step"}
    assert figures["segments"]["whole_step"]["bare_median_us"] > 0


def test_ring_read_launch_quick():
    _, figures = run_benchmark("ring_read_launch.py")
    assert figures["benchmark"] == "ring_read_launch" and figures["ring"] == 500
    assert figures["idle"]["n"] > 0 and figures["reading"]["n"] > 0
    assert figures["reads"] >= 1, "the ring was read during the reading blocks"
