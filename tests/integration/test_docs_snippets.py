"""The docs' Python programs, run for real: each whole ```python program of README.md and
docs/**.md (tests/unit/test_docs.py says what a program and a fragment are, and checks that
each compiles and defines what it uses) runs under torchrun with 2 ranks on gloo,
127.0.0.1, as a newcomer would copy it into train.py; so does the README's
gradient-accumulation fragment, in place of the quick-start's loop it replaces."""

from __future__ import annotations

import re

import pytest

from tests.helpers.jobs import value, wait_until
from tests.helpers.userjob import UserJob
from tests.unit.test_docs import PYTHON_BLOCKS, REPO, python_programs

QUICK_START_STEPS = 4096 // 2 // 64   # the quick-start's data set, over 2 ranks, in batches of 64


def quick_start():
    (block,) = [b for b in python_programs() if b.path == REPO / "README.md"]
    return block


def accumulation_fragment():
    (block,) = [b for b in PYTHON_BLOCKS if b.path == REPO / "README.md" and "no_sync()" in b.code]
    return block


def run_program(code: str, tmp_path, name: str) -> tuple[UserJob, list]:
    script = tmp_path / "train.py"
    script.write_text(code)
    job = UserJob(script, nproc=2, tmp_path=tmp_path, name=name)
    with job:
        job.run(timeout=240)
        samples = wait_until(lambda: (lambda s: all(job.state(s, r) == "finished" for r in (0, 1)) and s)(job.scrape()),
                             timeout=30, what="both ranks finished at the exporter")
    return job, samples


def steps(job: UserJob, samples, rank: int) -> float | None:
    return value(job.series(samples, "rankscope_steps_total", rank=str(rank)), "rankscope_steps_total")


@pytest.mark.parametrize("block", python_programs(), ids=lambda b: b.where)
def test_every_program_in_the_docs_runs_under_torchrun(block, tmp_path):
    job, samples = run_program(block.code, tmp_path, "program")
    for rank in (0, 1):
        assert (steps(job, samples, rank) or 0) > 0, f"{block.where}: rank {rank} counted no step"
    if block == quick_start():   # and reports what the README says it does
        for rank in (0, 1):
            r = str(rank)
            assert steps(job, samples, rank) == QUICK_START_STEPS
            for name in ("rankscope_loss", "rankscope_grad_norm", "rankscope_learning_rate"):
                found = job.series(samples, name, rank=r)
                assert len(found) == 1 and found[0].value == found[0].value, f"rank {rank}: {name} {found}"
            assert value(job.series(samples, "rankscope_samples_total", rank=r), "rankscope_samples_total") == \
                QUICK_START_STEPS * 64
            phases = {s.labels["phase"]: s.value for s in job.series(samples, "rankscope_phase_seconds_total", rank=r)}
            assert all(phases[p] > 0 for p in ("data", "forward", "backward", "optimizer")), phases
            dropped = [s for s in job.series(samples, "rankscope_telemetry_dropped_total", rank=r) if s.value]
            assert not dropped, f"rank {rank} threw values away: {dropped}"


def test_the_readme_gradient_accumulation_fragment_runs_in_place_of_the_quick_starts_loop(tmp_path):
    program = quick_start().code
    loop = re.search(r"^for x, y in monitor\.data\(loader\):.*\n(?:    .*\n)+", program, re.M)
    assert loop, "the quick-start's loop"
    code = program[:loop.start()] + accumulation_fragment().code + program[loop.end():]
    job, samples = run_program(code, tmp_path, "accumulation")
    accumulate = int(re.search(r"^accumulate = (\d+)", accumulation_fragment().code, re.M).group(1))
    for rank in (0, 1):
        r = str(rank)
        assert steps(job, samples, rank) == QUICK_START_STEPS // accumulate
        loss = job.series(samples, "rankscope_loss", rank=r)
        assert len(loss) == 1 and loss[0].value == loss[0].value and loss[0].value > 0, loss
        dropped = [s for s in job.series(samples, "rankscope_telemetry_dropped_total", rank=r) if s.value]
        assert not dropped, f"rank {rank} threw values away (the list of losses): {dropped}"
