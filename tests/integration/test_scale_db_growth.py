"""The proposed compaction of dead rank processes' .db files (tests/scale/db_growth.py)
keeps every count: prometheus_client's merge gives the same series and counts after it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_compaction_keeps_every_count():
    r = subprocess.run([sys.executable, "-m", "tests.scale.db_growth", "--dead", "200", "--repeat", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["counts_identical"] and report["sums_within_1e-12"], report
    assert report["files_removed"] == 2 * 200  # each dead process's counter and histogram file
    assert report["files_compacted"] == report["files_grown"] - 400 + 2  # + one compacted file per type
