"""rankscope.integrations.lightning in a real Lightning job (tests/loops/lightning_trainer.py).

One job serves every check here: ``Trainer(accelerator="cpu", devices=2,
strategy="ddp")`` (Lightning launches the second rank itself; gloo), a small
MLP on synthetic data, the module logging its gradient norm with Lightning's
``grad_norm`` utility, a checkpoint every CHECKPOINT_EVERY steps followed by a
validation (ModelCheckpoint saves before the validation of the same step), and a NaN loss on
rank 1 at step NAN_STEP (its gradient stays finite, so only rank 1's loss is
non-finite). Its node exporter is scraped while it runs by Debian's Prometheus
with the fast rules, which page through the shipped Alertmanager routes. A
second, shorter job (watched by a stack of its own) raises an out-of-memory error in rank 1's training_step, a
third hangs it.
Each check compares what rankscope published with what Lightning itself saw
on that rank (the script's own records).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from tests.helpers.adapter_jobs import PagedJob, final_values, wait_until_hang_located
from tests.helpers.paging import render_rules
from tests.helpers.userjob import UserJob

STEPS = 40
BATCH = 16            # lightning_trainer.py's batch size
COLLATE_S = 0.01      # each batch's collate
LR, LR_EVERY = 0.05, 10   # StepLR: halved every 10 steps
CHECKPOINT_EVERY = 20
NAN_STEP, FAULT_RANK = 20, "1"
OOM_STEP = 3
HANG_STEP = 3
RANKS = ("0", "1")


@dataclass
class Run:
    results: dict           # rank (int) -> what Lightning saw (the script's json)
    final: dict             # (metric, rank, extra label) -> value, from the exporter after the job
    page: dict | None = None
    nonfinite_pages: list | None = None
    returncode: int = 0


def _main_job(tmp) -> Run:
    rules = render_rules(tmp / "rules", fast=True)
    job = UserJob("lightning_trainer.py", "--steps", STEPS, "--checkpoint-every", CHECKPOINT_EVERY,
                  "--val-every", CHECKPOINT_EVERY, "--nan-rank", FAULT_RANK, "--nan-step", NAN_STEP, tmp_path=tmp,
                  name="lightning")
    with PagedJob(job, rules) as paged:
        job.wait(timeout=240)
        final = paged.final_values()
        delivery = paged.wait_for_page("RankscopeNonFiniteLoss", rank=FAULT_RANK)
        page = next(a for a in delivery.alerts if a["labels"].get("rank") == FAULT_RANK)
        return Run(job.results(), final, page, paged.pages("RankscopeNonFiniteLoss"))


def _oom_job(tmp) -> Run:
    rules = render_rules(tmp / "rules", fast=True)
    job = UserJob("lightning_trainer.py", "--steps", "10", "--oom-rank", FAULT_RANK, "--oom-step", OOM_STEP,
                  tmp_path=tmp, name="lightning-oom")
    with PagedJob(job, rules) as paged:
        rc = job.wait(timeout=180, check=False)
        final = final_values(job)
        delivery = paged.wait_for_page("RankscopeOutOfMemory", rank=FAULT_RANK)
        page = next(a for a in delivery.alerts if a["labels"].get("rank") == FAULT_RANK)
        return Run({}, final, page, returncode=rc)


def _hang_job(tmp) -> Run:
    """Rank 1 never returns from training_step; the exporter (its thresholds cut to 3 s) must name it."""
    env = {"RANKSCOPE_SUSPECT_AFTER_S": "3", "RANKSCOPE_STUCK_AFTER_S": "3"}
    with UserJob("lightning_trainer.py", "--steps", "10", "--hang-rank", FAULT_RANK, "--hang-step", HANG_STEP,
                 tmp_path=tmp, env=env, name="lightning-hang") as job:
        job.start()
        return Run({}, wait_until_hang_located(job, culprit=FAULT_RANK))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    # The fault jobs are short; they run beside the main one (each check compares clocks of one process).
    with ThreadPoolExecutor(max_workers=2) as pool:
        main = pool.submit(_main_job, tmp_path_factory.mktemp("lightning-main"))
        oom = pool.submit(_oom_job, tmp_path_factory.mktemp("lightning-oom"))
        hang = pool.submit(_hang_job, tmp_path_factory.mktemp("lightning-hang"))
        return {"main": main.result(), "oom": oom.result(), "hang": hang.result()}


@pytest.fixture(scope="module")
def run(runs) -> Run:
    return runs["main"]


def value(run: Run, name: str, rank: str, extra: str = "") -> float:
    return run.final.get((name, rank, extra), math.nan)


def zero_or_absent(v: float) -> bool:
    return v == 0 or math.isnan(v)


def test_steps_total_is_lightnings_global_step_on_every_rank(run):
    assert set(run.results) == {0, 1}
    for rank in RANKS:
        assert run.results[int(rank)]["global_step"] == STEPS
        assert value(run, "rankscope_steps_total", rank) == STEPS
        assert value(run, "rankscope_step", rank) == STEPS   # Lightning's global_step, not one behind
        assert value(run, "rankscope_rank_state", rank, "finished") == 1


def test_phases_sum_to_the_step_time_and_step_time_matches_lightnings_timer(run):
    """Lightning's Timer callback times the whole fit loop: its steps and, between them, the
    checkpoint saves (timed from Lightning's on_save_checkpoint to the next event) and the
    validations (on_validation_start to on_validation_end)."""
    for rank in RANKS:
        steps_s = value(run, "rankscope_step_duration_seconds_sum", rank)
        phases = {p: value(run, "rankscope_phase_seconds_total", rank, p)
                  for p in ("data", "forward", "backward", "optimizer", "comm_wait", "other")}
        assert sum(phases.values()) == pytest.approx(steps_s, rel=1e-6, abs=1e-6), phases
        assert phases["data"] >= STEPS * COLLATE_S, phases   # every batch's collate
        assert phases["forward"] > 0 and phases["backward"] > 0 and phases["optimizer"] > 0, phases
        assert value(run, "rankscope_user_checkpoint_save_seconds_count", rank) == STEPS // CHECKPOINT_EVERY
        save_s = value(run, "rankscope_user_checkpoint_save_seconds_sum", rank)
        eval_s = value(run, "rankscope_wall_seconds_total", rank, "evaluation")
        timer_s = run.results[int(rank)]["train_time"]
        assert steps_s + save_s + eval_s == pytest.approx(timer_s, rel=0.05), (steps_s, save_s, eval_s, timer_s)
        # The same saves are goodput's checkpoint_save badput (rankscope.step.goodput).
        assert value(run, "rankscope_wall_seconds_total", rank, "checkpoint_save") == pytest.approx(save_s, rel=0.02)


def test_validation_and_checkpoint_seconds_are_each_their_own(run):
    """ModelCheckpoint writes, then the validation of the same step runs: each is booked as
    itself (it once read 4 s of checkpoint saving for 0.05 s of writes: the validation inside
    it), within 10% of the times the job measured around them. Rank 0 writes; every rank
    waits for the write to end."""
    written_s = run.results[0]["checkpoint_write_s"]
    assert written_s >= STEPS // CHECKPOINT_EVERY * 0.3   # lightning_trainer.py's SAVE_S per write
    for rank in RANKS:
        validated_s, validations = run.results[int(rank)]["validation_s"], run.results[int(rank)]["validations"]
        # VAL_BATCHES (4) shared by the 2 ranks, VAL_BATCH_S (0.1 s) each
        assert validations >= 1 and validated_s >= validations * 2 * 0.1
        evaluation = value(run, "rankscope_wall_seconds_total", rank, "evaluation")
        saving = value(run, "rankscope_wall_seconds_total", rank, "checkpoint_save")
        assert evaluation == pytest.approx(validated_s, rel=0.10), (rank, evaluation, validated_s)
        assert saving == pytest.approx(written_s, rel=0.10), (rank, saving, written_s)


def test_per_rank_loss_is_each_ranks_own_and_they_differ(run):
    last = str(STEPS - 1)
    losses = {}
    for rank in RANKS:
        own = run.results[int(rank)]["own_loss"]
        assert len(own) == STEPS
        losses[rank] = value(run, "rankscope_loss", rank)
        assert losses[rank] == pytest.approx(own[last], rel=1e-5), (rank, losses[rank], own[last])
    assert losses["0"] != losses["1"]


def test_values_lightning_computes(run):
    last = str(STEPS - 1)
    for rank in RANKS:
        # the rate the last step trained at (StepLR per step), the norm the module logged
        assert value(run, "rankscope_learning_rate", rank) == pytest.approx(LR * 0.5 ** ((STEPS - 1) // LR_EVERY))
        own_norm = run.results[int(rank)]["own_grad_norm"][last]
        assert value(run, "rankscope_grad_norm", rank) == pytest.approx(own_norm, rel=1e-5)
        assert value(run, "rankscope_samples_total", rank) == STEPS * BATCH
        for component in ("step", "publisher", "collectives"):
            assert zero_or_absent(value(run, "rankscope_telemetry_errors_total", rank, component)), component


def test_bucket_all_reduces_are_timed(run):
    """CPU default (comm_timing=auto -> DDP's own timers): one record per sampled step (1 in 10),
    each the whole model's gradient bytes."""
    for rank in RANKS:
        count = value(run, "rankscope_collective_duration_seconds_count", rank, "all_reduce")
        total = value(run, "rankscope_collective_bytes_total", rank, "all_reduce")
        assert STEPS // 10 - 1 <= count <= STEPS // 10 + 1, count
        assert total == count * run.results[int(rank)]["param_bytes"]
        assert value(run, "rankscope_collective_duration_seconds_sum", rank, "all_reduce") > 0


def test_nan_loss_on_rank_1_pages_naming_rank_1(run):
    assert math.isnan(run.results[1]["own_loss"][str(NAN_STEP)])
    assert value(run, "rankscope_nonfinite_total", FAULT_RANK, "loss") == 1
    assert zero_or_absent(value(run, "rankscope_nonfinite_total", "0", "loss"))
    labels = run.page["labels"]
    assert labels["alertname"] == "RankscopeNonFiniteLoss" and labels["rank"] == FAULT_RANK
    assert f"rank {FAULT_RANK}" in run.page["annotations"]["description"]
    assert {a["labels"]["rank"] for a in run.nonfinite_pages} == {FAULT_RANK}


def test_an_oom_in_training_step_is_counted_paged_and_the_rank_fails(runs):
    run = runs["oom"]
    assert run.returncode != 0
    assert value(run, "rankscope_oom_total", FAULT_RANK) == 1
    assert value(run, "rankscope_steps_total", FAULT_RANK) == OOM_STEP   # the failed step is not counted
    assert value(run, "rankscope_rank_failure_info", FAULT_RANK, "OutOfMemoryError") == 1
    assert value(run, "rankscope_rank_state", FAULT_RANK, "finished") == 0
    assert run.page["labels"]["alertname"] == "RankscopeOutOfMemory"   # paged through Prometheus + Alertmanager


def test_a_hang_in_training_step_is_located(runs):
    """Rank 1 hangs in training_step; rank 0 blocks in the step's gradient all-reduce, inside the
    backward phase the adapter opened at on_before_backward."""
    run = runs["hang"]
    assert value(run, "rankscope_hang_suspect", FAULT_RANK) == 1, run.final
    assert value(run, "rankscope_hang_suspect", "0") == 0
    assert value(run, "rankscope_rank_state", "0", "stuck_in_collective") == 1
    assert value(run, "rankscope_collective_in_flight", "0", "all_reduce") == 1
    assert value(run, "rankscope_steps_total", FAULT_RANK) == HANG_STEP
