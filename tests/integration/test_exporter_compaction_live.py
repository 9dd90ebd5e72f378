"""Compaction inside a real exporter process (the unit tests: tests/unit/exporter/test_compaction.py)."""

from __future__ import annotations
import subprocess
import sys
import pytest
from prometheus_client.multiprocess import MultiProcessCollector
from rankscope.contract.rundir import load_registrations
from rankscope.exporter.reader import Reader
from tests.unit.exporter.test_reader import canon, files_of

from tests.unit.exporter.test_compaction import (FARM, MONOTONIC, assert_same_counts)  # noqa: F401 - fixtures too


@pytest.mark.integration
def test_exporter_compacts_many_restarted_processes_and_serves_the_same_counts(tmp_path):
    from tests.helpers.exporter_proc import ExporterProcess, _env
    from tests.helpers.jobs import REPO, parse, scrape_text, wait_until

    n = 120
    run_dir = tmp_path / "farm"
    # The farm process stays alive while its children die: one launch (agent) restarting ranks.
    farm = subprocess.run([sys.executable, "-c", FARM, str(run_dir), str(n)], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert farm.returncode == 0 and "done" in farm.stdout, farm.stderr
    steps = {str(r): sum(i + 1 for i in range(n) if i % 8 == r) for r in range(8)}
    assert len(list(run_dir.glob("*.db"))) >= 3 * n

    def counters(text: str) -> dict:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in parse(text)
                if s.labels.get("run") == "farm" and s.name.endswith(MONOTONIC)}

    with ExporterProcess(tmp_path, args=["--compact-after", "6"]) as exporter:
        before = counters(scrape_text(exporter.url))
        files_seen = len(list(run_dir.glob("*.db")))
        assert files_seen >= 3 * n, "the scrape above was served before any compaction"
        assert {k[1]: v for k, v in before.items() if k[0] == "rankscope_steps_total"} == {
            tuple(sorted({"run": "farm", "rank": r, "local_rank": r, "node": "n"}.items())): float(v)
            for r, v in steps.items()}
        wait_until(lambda: len(list(run_dir.glob("*.db"))) < 10, timeout=60, interval=0.5,
                   what="the janitor compacts the dead processes' files")
        after = counters(scrape_text(exporter.url))
        assert "compacted" in exporter.log()
    assert_same_counts(before, after)
    paths = files_of(run_dir)
    assert canon(Reader().merge(run_dir, paths)) == canon(MultiProcessCollector.merge(paths, accumulate=True))
    assert len(load_registrations(run_dir)) <= 8 + 1   # the newest process of each rank, and the keeper
