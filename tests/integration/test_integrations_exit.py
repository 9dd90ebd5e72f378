"""The exit hook of a whole interpreter (tests/unit/integrations/test_events.py's, with a real process)."""

from __future__ import annotations
import os
import subprocess
import sys
import pytest

from tests.unit.integrations.test_events import (LAUNCH_VARS, UNCAUGHT_IN_OPEN_STEP, read_run)  # noqa: F401 - fixtures too


@pytest.mark.integration   # a whole interpreter with torch and a Monitor: seconds, kept out of the fast tier
def test_an_uncaught_oom_in_an_open_step_is_counted_at_exit(tmp_path):
    """The adapters' steps have no with-block: the exit hook ends the open step with the
    exception that ends the interpreter, so the OOM still counts."""
    from rankscope.contract.rundir import load_registrations

    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and k != "PROMETHEUS_MULTIPROC_DIR"}
    proc = subprocess.run([sys.executable, "-c", UNCAUGHT_IN_OPEN_STEP, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    (reg,) = load_registrations(tmp_path / "uncaught")
    assert reg.exception == "OutOfMemoryError"
    assert read_run(tmp_path / "uncaught")[("rankscope_oom_total",)] == 1
