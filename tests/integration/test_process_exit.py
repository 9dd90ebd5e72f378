"""A rank's interpreter exiting: what the exit hooks do, each in a real child interpreter.

Out of the fast tier (each starts a Python with torch, 2-3 s): the Monitor's exit hook
marks a rank that dies of an uncaught exception ``failed`` (and one that exits cleanly
``finished``), and the span process never delays the exit behind a collector that accepts
and never answers (the OpenTelemetry SDK's own exit handler would wait 30 s).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests.helpers.jobs import REPO
from tests.helpers.otlp_receiver import BlackHole
from tests.unit.test_monitor_api import LAUNCH_VARS


EXIT_SCRIPT = textwrap.dedent("""
    import sys, time
    from rankscope.identity import RankIdentity
    from rankscope.tracing.records import PhaseRecord, StepRecord
    from rankscope.tracing import build_tracing
    ident = RankIdentity(run="exit", rank=0, local_rank=0, world_size=1, local_world_size=1, node="n")
    tracing = build_tracing(ident, lambda: None, env={"OTEL_EXPORTER_OTLP_ENDPOINT": sys.argv[1]})
    t = time.time()
    for step in range(2000):
        tracing.submit(StepRecord(step=step, start=t, duration=0.01, phases=[PhaseRecord("forward", t, 0.01)]))
    time.sleep(1.5)  # let the exporter start a (hanging) export
    if sys.argv[2] == "shutdown":
        tracing.shutdown(1.0)
    print("last-line", time.time(), flush=True)
""")


@pytest.mark.parametrize("how", ["shutdown", "no_shutdown"])
def test_interpreter_exit_is_not_delayed_by_a_black_hole(how):
    """The SDK's own atexit handler would wait 30 s (docs/performance.md, "Library costs"); ours must not."""
    with BlackHole() as hole:
        proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, hole.endpoint, how], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        exited = time.time()
    assert proc.returncode == 0, proc.stderr
    last = float(proc.stdout.split("last-line")[1])
    # The SDK's handler would take 30 s; 5 s leaves room for a loaded machine.
    assert exited - last < 5.0, f"exit took {exited - last:.1f}s after the last line"


UNCAUGHT = """
import sys
from rankscope import Monitor
m = Monitor(exporter="off", metrics_dir=sys.argv[1], run="uncaught")
with m.step():
    pass
if sys.argv[2] == "raise":
    raise RuntimeError("Connection closed by peer")
sys.exit(0)
"""


@pytest.mark.parametrize("how, exception", [("raise", "RuntimeError"), ("exit", "")])
def test_an_uncaught_exception_marks_the_rank_failed_at_exit(tmp_path, how, exception):
    """No close() in the script: the exit hook closes the monitor, after the
    exception hook has seen the exception that ends the interpreter."""
    from rankscope.contract.rundir import load_registrations

    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    proc = subprocess.run([sys.executable, "-c", UNCAUGHT, str(tmp_path), how], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == (1 if exception else 0), proc.stderr
    (reg,) = load_registrations(tmp_path / "uncaught")
    assert reg.exception == exception
    assert bool(reg.finished_at) == (not exception) and bool(reg.failed_at) == bool(exception)
