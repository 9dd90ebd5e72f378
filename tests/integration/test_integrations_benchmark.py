"""tests/benchmarks/adapters.py runs end to end with tiny parameters (a smoke run, as
tests/integration/test_benchmarks_smoke.py does for the other benchmarks): both frameworks' 2-rank jobs,
the table, and a final JSON line with a paired figure per rank. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_adapters_benchmark_quick():
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "benchmarks" / "adapters.py"), "--quick"], cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    lines = proc.stdout.strip().splitlines()
    assert any(line.startswith("|---") or line.startswith("|-") for line in lines), "no table"
    figures = json.loads(lines[-1])
    assert figures["benchmark"] == "adapters"
    for framework in ("hf", "lightning"):
        result = figures["frameworks"][framework]
        assert result["scrapes_ok"] >= 1, f"{framework}: the exporter was never scraped during the job"
        for rank in ("0", "1"):
            for figure in ("block_mean", "block_median"):
                c = result["ranks"][rank][figure]
                assert c["pairs"] == 2 and c["bare_step_ms"] > 0
                assert c["ci_frac"][0] <= c["frac"] <= c["ci_frac"][1]
