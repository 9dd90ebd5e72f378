"""tests/benchmarks/adapters.py and adapter_hooks.py run end to end with tiny parameters (smoke runs,
as tests/integration/test_benchmarks_smoke.py does for the other benchmarks): each framework's 2-rank
job (torchtitan's where .venv-torchtitan is, as in CI), the table, and a final JSON line with the paired
figures per rank; each hook's time. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_adapters_benchmark_quick():
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}   # an earlier test's
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "benchmarks" / "adapters.py"), "--quick",
                           "--framework", "lightning", "hf", "--hidden", "64"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    lines = proc.stdout.strip().splitlines()
    assert any(line.startswith("|---") or line.startswith("|-") for line in lines), "no table"
    figures = json.loads(lines[-1])
    assert figures["benchmark"] == "adapters"
    assert set(figures["frameworks"]) == {"hf", "lightning"}
    for framework, result in figures["frameworks"].items():
        assert result["scrapes_ok"] >= 1, f"{framework}: the exporter was never scraped during the job"
        for rank in ("0", "1"):
            f = result["ranks"][rank]
            assert f["quads"] == 5 and f["bare_step_ms"] > 0   # steps 4-23 after a warm-up of 4
            for figure in ("wall", "cpu"):
                assert f[figure]["ci_frac"][0] <= f[figure]["frac"] <= f[figure]["ci_frac"][1]
            assert 0 <= f["background_core_frac"] < 1


@pytest.mark.skipif(not (REPO / ".venv-torchtitan" / "bin" / "python").exists()
                    and not os.environ.get("RANKSCOPE_REQUIRE_TORCHTITAN"),
                    reason=".venv-torchtitan is missing: tests/run.sh makes it (tests/scripts/torchtitan_venv.sh)")
def test_adapters_benchmark_torchtitan_quick():
    """torchtitan's job (tests/loops/torchtitan_job.py) with the Trainer's wrappers switched step by step."""
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "benchmarks" / "adapters.py"), "--quick",
                           "--framework", "torchtitan"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])["frameworks"]["torchtitan"]
    for rank in ("0", "1"):
        f = result["ranks"][rank]
        assert f["quads"] == 2 and f["bare_step_ms"] > 0   # steps 4-11 after a warm-up of 4
        assert f["wall"]["ci_frac"][0] <= f["wall"]["frac"] <= f["wall"]["ci_frac"][1]


def test_adapter_hooks_benchmark_quick():
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}   # an earlier test's
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "benchmarks" / "adapter_hooks.py"), "--steps", "40"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["benchmark"] == "adapter_hooks" and figures["step_us"] > 0
    assert set(figures["hooks_us"]) == {"on_train_batch_start", "on_before_backward", "on_after_backward",
                                        "on_before_optimizer_step", "on_train_batch_end"}
    assert all(us > 0 for us in figures["hooks_us"].values())
