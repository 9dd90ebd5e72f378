"""A step's values are always read together: the rank's publisher and the node exporter's reader,
in two processes, as in production.

A writer process publishes a step every ~0.1 ms through the publisher's own
``write_step_values`` (step k: loss k + 0.25, gradient norm k + 0.5, learning
rate k + 0.75, duration and compute k; the real publisher writes once a second),
while this process reads the files with the exporter's ``RunReader`` as a scrape
does, over and over. Every read must show one
step's values. The same reads with the fence check switched off show torn copies
(one step's loss beside another's gradient norm): the check is what keeps them out.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from rankscope.exporter import db_file, reader

WRITER = """
import sys
import time
from pathlib import Path
from rankscope.publishing.metrics import RankMetrics
from rankscope.publishing.publisher import write_step_values
from rankscope.step.accounting import Accumulator

m = RankMetrics(Path(sys.argv[1]), {"run": "together", "rank": "0", "local_rank": "0", "node": "n"})
print("ready", flush=True)
k = 0
while True:
    k += 1
    acc = Accumulator()
    acc.steps, acc.last_step, acc.last_duration, acc.last_end, acc.last_compute = 1, k, float(k), float(k), float(k)
    acc.observed = {"loss": k + 0.25, "grad_norm": k + 0.5, "lr": k + 0.75}
    write_step_values(m, acc)
    time.sleep(0.0001)
"""

OFFSETS = {"rankscope_loss": 0.25, "rankscope_grad_norm": 0.5, "rankscope_learning_rate": 0.75,
           "rankscope_step_last_duration_seconds": 0.0, "rankscope_step_last_compute_seconds": 0.0,
           "rankscope_last_step_timestamp_seconds": 0.0}


def read_for(directory: Path, seconds: float) -> tuple[int, int, set[str]]:
    """(reads, reads that mixed steps, families seen) over ``seconds`` of back-to-back scrapes."""
    run = reader.RunReader()
    reads = mixed = 0
    names: set[str] = set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        values = {}
        for family in run.merge([str(p) for p in directory.glob("*.db")]):
            names.add(family.name)
            for sample in family.samples:
                values[sample.name] = sample.value
        step = values.get("rankscope_step", 0.0)
        if step < 1:
            continue
        reads += 1
        if any(values[name] != step + offset for name, offset in OFFSETS.items()):
            mixed += 1
    return reads, mixed, names


def test_a_scrape_never_mixes_two_steps_values(tmp_path, monkeypatch):
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}   # an earlier test's
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], env=env, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert writer.stdout.readline().strip() == "ready"
        reads, mixed, names = read_for(tmp_path, 3.0)
        assert reads > 1000 and mixed == 0, (reads, mixed)
        assert not names & reader.FENCE_NAMES   # the fences are never exported
        # The control: without the fence check the same reads do tear.
        monkeypatch.setattr(db_file, "_fence_offsets", lambda data: None)
        reads, mixed, _ = read_for(tmp_path, 3.0)
        assert reads > 1000 and mixed > 0, (reads, mixed)
    finally:
        writer.kill()
        writer.wait()
