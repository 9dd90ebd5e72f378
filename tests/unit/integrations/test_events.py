"""Steps driven by events (what the framework adapters use), in process, and the adapters'
import rules. Real Monitors writing metric files under tmp_path, read back as the node
exporter reads them; no framework Trainer runs here (tests/integration/test_integrations_hf.py and
tests/integration/test_integrations_lightning.py run real ones).
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
from prometheus_client.multiprocess import MultiProcessCollector

from rankscope import Monitor
from rankscope.integrations.events import EventSteps

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT",
               "TORCHELASTIC_RUN_ID")


@pytest.fixture
def monitor(tmp_path, monkeypatch):
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    m = Monitor(exporter="off", metrics_dir=tmp_path, run="events", publish_interval_s=60)
    yield m
    m.close()


def read_run(run_dir) -> dict[tuple, float]:
    """(name, extra label values...) -> value, merged from a rank's metric files."""
    files = [str(p) for p in run_dir.glob("*.db")]
    out = {}
    for family in MultiProcessCollector.merge(files, accumulate=True):
        for s in family.samples:
            extra = tuple(v for k, v in sorted(s.labels.items()) if k not in ("run", "rank", "local_rank", "node"))
            out[(s.name, *extra)] = s.value
    return out


def published(m: Monitor) -> dict[tuple, float]:
    m.parts.publisher.publish()
    return read_run(m.run_dir)


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_begin_end_and_phase_start_stop_count_as_a_with_block_does(monitor):
    t0 = time.perf_counter()
    time.sleep(0.02)
    monitor.waited_for_data(t0, time.perf_counter())      # a batch fetched before the step
    step = monitor.step(step=7).begin()
    step.count(samples=4, tokens=128)
    forward = step.phase("forward").start()
    busy(0.01)
    forward.stop()
    step.count(samples=4, tokens=128)                      # a second micro-batch
    step.observe(loss=torch.tensor(2.5), lr=0.1)
    step.end()
    wall = time.perf_counter() - t0
    got = published(monitor)
    assert got[("rankscope_steps_total",)] == 1 and got[("rankscope_step",)] == 7
    assert got[("rankscope_samples_total",)] == 8 and got[("rankscope_tokens_total",)] == 256
    duration = got[("rankscope_step_duration_seconds_sum",)]
    assert 0.03 <= duration <= wall                         # the step began when its batch's fetch did
    assert got[("rankscope_phase_seconds_total", "data")] >= 0.02
    assert got[("rankscope_phase_seconds_total", "forward")] >= 0.01
    phases = sum(v for k, v in got.items() if k[0] == "rankscope_phase_seconds_total")
    assert phases == pytest.approx(duration, rel=1e-9)
    assert got[("rankscope_loss",)] == 2.5 and got[("rankscope_learning_rate",)] == 0.1
    step.end()                                              # a second end() does nothing
    assert published(monitor)[("rankscope_steps_total",)] == 1


def test_a_step_ended_by_an_oom_is_counted_as_one_not_as_a_completed_step(monitor):
    step = monitor.step().begin()
    step.end(torch.OutOfMemoryError("CUDA out of memory"))
    got = published(monitor)
    assert got[("rankscope_oom_total",)] == 1
    assert got[("rankscope_steps_total",)] == 0


def test_event_steps_add_micro_batch_losses_and_keep_saves_out_of_steps(monitor):
    steps = EventSteps(monitor)
    steps.begin(0)
    for loss in (torch.tensor(1.5), torch.tensor(2.0)):    # two micro-batches, each already / 2
        steps.switch("forward")
        steps.switch("backward")
        steps.add_loss(loss)
    steps.switch("optimizer")
    steps.grad_norm, steps.lr = torch.tensor(3.0), 0.01
    steps.end()
    saving = time.perf_counter()
    time.sleep(0.05)                                        # the framework writes a checkpoint
    steps.checkpoint_saved(started=saving)
    steps.begin(1)
    steps.end()
    got = published(monitor)
    assert got[("rankscope_steps_total",)] == 2
    assert got[("rankscope_loss",)] == 3.5 and got[("rankscope_grad_norm",)] == 3.0
    assert got[("rankscope_user_checkpoint_save_seconds_count",)] == 1
    assert got[("rankscope_user_checkpoint_save_seconds_sum",)] >= 0.05
    assert got[("rankscope_step_duration_seconds_sum",)] < 0.05   # the save is in no step
    assert got[("rankscope_phase_seconds_total", "data")] < 0.05


def test_a_save_whose_end_no_event_marks_lasts_until_the_next_step(monitor):
    steps = EventSteps(monitor)
    steps.checkpoint_saving()
    time.sleep(0.05)
    steps.begin(0)
    steps.end()
    got = published(monitor)
    assert got[("rankscope_user_checkpoint_save_seconds_sum",)] >= 0.05
    assert got[("rankscope_phase_seconds_total", "data")] < 0.05   # never counted as data wait


def test_a_new_step_before_the_last_one_ended_does_not_count_the_unfinished_one(monitor):
    steps = EventSteps(monitor)
    steps.begin(0)
    steps.begin(1)
    steps.end()
    assert published(monitor)[("rankscope_steps_total",)] == 1


def test_closing_with_a_step_open_during_an_oom_counts_it(tmp_path, monkeypatch):
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    m = Monitor(exporter="off", metrics_dir=tmp_path, run="close")
    m.step().begin()
    with pytest.raises(torch.OutOfMemoryError):
        try:
            raise torch.OutOfMemoryError("CUDA out of memory")
        finally:
            m.close()
    got = read_run(m.run_dir)
    assert got[("rankscope_oom_total",)] == 1 and got[("rankscope_steps_total",)] == 0


UNCAUGHT_IN_OPEN_STEP = """
import sys, torch
from rankscope import Monitor
m = Monitor(exporter="off", metrics_dir=sys.argv[1], run="uncaught")
m.step().begin()          # a framework's step, cut short by an OOM nobody catches
raise torch.OutOfMemoryError("CUDA out of memory")
"""


IMPORTS = """
import sys
import rankscope, rankscope.integrations, rankscope.integrations.events
frameworks = [m for m in ("transformers", "lightning", "pytorch_lightning", "accelerate", "torchtitan")
              if m in sys.modules]
assert not frameworks, frameworks
for name in ("transformers", "lightning", "pytorch_lightning", "torchtitan"):
    sys.modules[name] = None        # as if not installed
for module, extra in (("hf", "hf"), ("lightning", "lightning"), ("torchtitan", "torchtitan")):
    try:
        __import__("rankscope.integrations." + module)
    except ImportError as e:
        assert f"rankscope[{extra}]" in str(e), e
    else:
        raise AssertionError(module + " imported without its framework")
print("ok")
"""


def test_the_core_imports_no_framework_and_a_missing_one_names_its_extra():
    proc = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_the_integrations_subpackage_is_in_the_wheel():
    """setuptools lists packages explicitly (pyproject [tool.setuptools] packages): a subpackage
    missing there is missing from the wheel, and `import rankscope.integrations.hf` fails there."""
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())
    setuptools = pyproject["tool"]["setuptools"]
    assert "rankscope.integrations" in setuptools["packages"]
    assert set(pyproject["project"]["optional-dependencies"]) >= {"hf", "lightning"}


def test_hf_instrumented_training_step_counts_every_kind_of_micro_batch(monitor):
    """instrument()'s training_step counts each micro-batch as the Trainer hands it over: a dict, a
    BatchEncoding (a Mapping, not a dict: what tokenizers and their collators return) or a custom
    collator's tuple; without instrument(), the forward pre-hook counts what the model is given."""
    transformers = pytest.importorskip("transformers")
    from rankscope.integrations.hf import RankscopeCallback

    callback = RankscopeCallback(monitor=monitor)
    callback.steps = EventSteps(monitor)
    callback.steps.begin(1)
    ids = torch.zeros(4, 16, dtype=torch.long)
    callback._micro_batch_starts({"input_ids": ids, "labels": ids})
    callback._micro_batch_starts(transformers.BatchEncoding({"input_ids": ids}))
    callback._micro_batch_starts((torch.zeros(2, 8), torch.zeros(2)))
    # Without instrument(), the forward pre-hook: keyword input ids, or the first positional input
    model = torch.nn.Linear(1, 1)
    callback._forward_starts(model, (), {"input_ids": ids, "labels": ids})
    callback._forward_starts(model, (torch.zeros(3, 5),), {"labels": ids})
    callback.steps.end()
    got = published(monitor)
    assert got[("rankscope_samples_total",)] == 4 + 4 + 2 + 4 + 3
    assert got[("rankscope_tokens_total",)] == 64 + 64 + 16 + 64 + 15
    assert got.get(("rankscope_telemetry_errors_total", "step"), 0) == 0
