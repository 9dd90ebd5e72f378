"""rankscope.integrations.torchtitan in a real torchtitan job (tests/loops/torchtitan_job.py).

torchtitan 0.3.0's own ``main``, launched by ``torchrun`` through rankscope's launcher
(``python -m rankscope.integrations.torchtitan``'s ``main``), trains its llama3 debug
model on 2 ranks (FSDP over both, gloo) on a tokenizer and dataset this module makes,
with checkpoints and validation on. The job runs in its own virtual environment
(``.venv-torchtitan``, made by tests/run.sh: torchtitan pins ``datasets<4.8``, whose
``huggingface_hub`` cannot live beside the transformers the HF adapter is tested
with). What the job changes in torchtitan to run on a CPU is listed in the job's
docstring; the adapter changes nothing.

Each check compares what rankscope published (the job's node exporter, after the
job) with what torchtitan itself saw: its logged metrics (``MetricsProcessor.log``),
its structured log's spans, and the flight recorder's ring dumped when training ended.
A second job, watched by Prometheus with the fast rules and the shipped Alertmanager
routes, hangs rank 1 before a forward: the page names rank 1.
"""

from __future__ import annotations

import collections
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.adapter_jobs import PagedJob, final_values
from tests.helpers.jobs import REPO, select
from tests.helpers.paging import render_rules
from tests.helpers.promstack import firing_alerts
from tests.helpers.titan_assets import make_assets
from tests.helpers.userjob import UserJob

from rankscope.collectives.ring_entries import op_of

VENV = REPO / ".venv-torchtitan"
STEPS = 12
BATCH, SEQ_LEN = 4, 64           # torchtitan_job.py's local batch and sequence length
CHECKPOINT_EVERY, VALIDATE_EVERY = 5, 5
HANG_RANK, HANG_STEP = "1", 3
RANKS = ("0", "1")

pytestmark = pytest.mark.skipif(
    not (VENV / "bin" / "torchrun").exists() and not os.environ.get("RANKSCOPE_REQUIRE_TORCHTITAN"),
    reason=".venv-torchtitan is missing: tests/run.sh makes it (tests/scripts/torchtitan_venv.sh)")


@dataclass
class Run:
    final: dict                     # (metric, rank, extra label) -> value, from the exporter after the job
    samples: list                   # the exporter's last scrape, whole
    logged: dict                    # rank -> step -> MetricsProcessor.log's arguments
    spans: dict                     # rank -> span name -> total ms (torchtitan's structured log)
    recorded: dict                  # rank -> op -> flight-recorder entries
    page: dict | None = None


def _job(tmp: Path, *args: str, name: str, env: dict | None = None) -> UserJob:
    assert (VENV / "bin" / "torchrun").exists(), f"{VENV} is missing: bash tests/scripts/torchtitan_venv.sh"
    assets = make_assets(tmp / "assets")
    return UserJob("torchtitan_job.py", "--module", "torchtitan_job", "--config", "rankscope_cpu_debug",
                   "--dump_folder", tmp / "dump", "--parallelism.spmd_backend", "partial_dtensor", *args,
                   nproc=2, python=VENV / "bin" / "python", tmp_path=tmp, name=name,
                   env={"TITAN_ASSETS": str(assets), "HF_HOME": str(tmp / "hf"), "HF_DATASETS_OFFLINE": "1",
                        **(env or {})})


def _spans(dump: Path) -> dict:
    out: dict = {}
    for path in (dump / "structured_logs").glob("training.global_rank_*.jsonl"):
        rank = path.name.split("global_rank_")[1].split(".")[0]
        totals: dict = collections.Counter()
        for line in path.read_text().splitlines():
            record = json.loads(line)
            name = record.get("log_type_name", "")
            if name.endswith("_end") and record.get("value") is not None:
                totals[name[:-4]] += float(record["value"])
        out[rank] = totals
    return out


def _recorded(out: Path) -> dict:
    recorded = {}
    for rank in RANKS:
        entries = json.loads((out / f"rank{rank}.fr.json").read_text())["entries"]
        recorded[rank] = collections.Counter(op_of(e["profiling_name"]) for e in entries)
    return recorded


MAIN_ARGS = ("--training.steps", str(STEPS), "--debug.seed", "0",
             "--checkpoint.enable", "--checkpoint.interval", str(CHECKPOINT_EVERY),
             "--validator.enable", "--validator.freq", str(VALIDATE_EVERY), "--validator.steps", "2")


def _logged(job: UserJob) -> dict:
    logged = {}
    for rank in RANKS:
        lines = (job.out / f"rank{rank}.metrics.jsonl").read_text().splitlines()
        logged[rank] = {r["step"]: r for r in map(json.loads, lines)}
    return logged


def _bare_job(tmp: Path) -> dict:
    """The main job without rankscope: torchtitan's logged values, step by step."""
    job = _job(tmp, *MAIN_ARGS, name="torchtitan-bare", env={"TITAN_WITHOUT_RANKSCOPE": "1"})
    with job:
        job.start()
        job.wait(timeout=420)
    return _logged(job)


def _main_job(tmp: Path) -> Run:
    job = _job(tmp, *MAIN_ARGS, name="torchtitan")
    with job:
        job.start()
        job.wait(timeout=420)
        final, samples = final_values(job), job.scrape()
    return Run(final, samples, _logged(job), _spans(tmp / "dump"), _recorded(job.out))


def _hang_job(tmp: Path) -> Run:
    rules = render_rules(tmp / "rules", fast=True)
    job = _job(tmp, "--training.steps", "40", name="torchtitan-hang",
               env={"TITAN_HANG_RANK": HANG_RANK, "TITAN_HANG_STEP": str(HANG_STEP),
                    "RANKSCOPE_SUSPECT_AFTER_S": "3", "RANKSCOPE_STUCK_AFTER_S": "3"})
    with PagedJob(job, rules) as paged:
        def names_the_rank(d) -> bool:
            return d.path == "/page" and any(a["labels"].get("rank") == HANG_RANK for a in firing_alerts(d))
        delivery = paged.hook.wait_for(names_the_rank, timeout=90)
        page = next(a for a in firing_alerts(delivery) if a["labels"].get("rank") == HANG_RANK)
        paged_ranks = {(a["labels"]["alertname"], a["labels"].get("rank")) for d in paged.hook.snapshot()
                       if d.path == "/page" for a in firing_alerts(d) if a["labels"].get("run") == job.run_id}
        return Run(final_values(job), [], {}, {}, {}, page={"alert": page, "paged": paged_ranks})


STRICT_STEPS = 3


def _strict_job(tmp: Path) -> Run:
    """A few steps under the strict double of rankscope's CUDA boundary (TITAN_STRICT_CUDA): every
    tensor taken for one on cuda:1. Its violations, per rank, are the Run's ``logged``."""
    job = _job(tmp, "--training.steps", str(STRICT_STEPS), "--debug.seed", "0", name="torchtitan-strict",
               env={"TITAN_STRICT_CUDA": "1"})
    with job:
        job.start()
        job.wait(timeout=420)
        final = final_values(job)
    violations = {rank: json.loads((job.out / f"rank{rank}.strict.json").read_text()) for rank in RANKS}
    return Run(final, [], violations, {}, {})


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    # Two jobs at a time (2 cores): the bare one starts once the hang has paged. Each timing check
    # compares clocks of one process with each other, so the jobs may share the machine.
    with ThreadPoolExecutor(max_workers=2) as pool:
        main = pool.submit(_main_job, tmp_path_factory.mktemp("torchtitan-main"))
        hang = pool.submit(_hang_job, tmp_path_factory.mktemp("torchtitan-hang"))
        bare = pool.submit(_bare_job, tmp_path_factory.mktemp("torchtitan-bare"))
        strict = pool.submit(_strict_job, tmp_path_factory.mktemp("torchtitan-strict"))
        return {"main": main.result(), "hang": hang.result(), "bare": Run({}, [], bare.result(), {}, {}),
                "strict": strict.result()}


def test_the_adapter_under_the_strict_cuda_double_never_waits_or_strays(runs):
    """Every tensor of the job taken for one on cuda:1 (tests/helpers/strict_cuda.py): nothing of
    rankscope's, through the adapter's wrappers included, waits for the device on the training
    thread or touches a device from a thread that did not set it; the steps and losses are
    still published, through the device path."""
    strict = runs["strict"]
    for rank in RANKS:
        assert strict.logged[rank] == [], (rank, strict.logged[rank])
        assert value(strict, "rankscope_steps_total", rank) == STRICT_STEPS
        assert value(strict, "rankscope_loss", rank) > 0
        assert value(strict, "rankscope_grad_norm", rank) > 0


@pytest.fixture(scope="module")
def run(runs) -> Run:
    return runs["main"]


def value(run: Run, name: str, rank: str, extra: str = "") -> float:
    return run.final.get((name, rank, extra), math.nan)


def test_one_step_per_train_step_numbered_by_trainer_step(run):
    for rank in RANKS:
        assert max(run.logged[rank]) == STEPS
        assert value(run, "rankscope_steps_total", rank) == STEPS
        assert value(run, "rankscope_step", rank) == STEPS
        assert value(run, "rankscope_rank_state", rank, "finished") == 1
        for component in ("step", "publisher", "collectives"):
            errors = value(run, "rankscope_telemetry_errors_total", rank, component)
            assert errors == 0 or math.isnan(errors), component


def test_each_ranks_loss_is_its_own_mean_as_torchtitan_computes_it(run):
    """torchtitan logs the global mean (sum of the ranks' sums over all tokens) and the max of
    the ranks' own means; with equal token counts (packed sequences) the two ranks' own losses
    are the max and 2 x mean - max. rankscope's are exactly those: the global-token
    normalisation undone."""
    last = run.logged["0"][STEPS]
    losses = sorted(value(run, "rankscope_loss", rank) for rank in RANKS)
    assert losses[1] == last["max_loss"]
    assert losses[0] == pytest.approx(2 * last["avg_loss"] - last["max_loss"], rel=1e-6)
    assert losses[0] != losses[1]


def test_grad_norm_lr_tokens_and_samples_are_torchtitans(run):
    last = run.logged["0"][STEPS]
    for rank in RANKS:
        assert value(run, "rankscope_grad_norm", rank) == last["grad_norm"]
        assert value(run, "rankscope_learning_rate", rank) == last["extra"]["lr/AdamW"]
        assert value(run, "rankscope_tokens_total", rank) == STEPS * BATCH * SEQ_LEN
        assert value(run, "rankscope_samples_total", rank) == STEPS * BATCH
    # torchtitan's n_tokens_seen is the whole data-parallel batch's
    assert sum(value(run, "rankscope_tokens_total", rank) for rank in RANKS) == last["extra"]["n_tokens_seen"]


def test_phases_are_torchtitans_own_spans(run):
    """forward + backward is torchtitan's fwd_bwd span, optimizer its optim span, data its
    data-loading time (each summed over the run), within 5%."""
    for rank in RANKS:
        phase = {p: value(run, "rankscope_phase_seconds_total", rank, p) * 1000
                 for p in ("data", "forward", "backward", "optimizer", "other")}
        spans = run.spans[rank]
        assert phase["forward"] > 0 and phase["backward"] > 0, phase
        assert phase["forward"] + phase["backward"] == pytest.approx(spans["fwd_bwd"], rel=0.05), (phase, spans)
        assert phase["optimizer"] == pytest.approx(spans["optim"], rel=0.05), (phase, spans)
        # torchtitan's own data-loading time (its "data_loading" metric: its batch generator's
        # wait for the loader) is inside rankscope's; the fetching_batch span is outside it (and
        # also holds the structured logger's own writes, ~0.1 ms a batch).
        loading_ms = sum(r["data_loading_s"] for r in run.logged[rank].values()) * 1000
        assert loading_ms <= phase["data"] <= spans["fetching_batch"], (loading_ms, phase, spans)
        assert phase["data"] == pytest.approx(loading_ms, rel=0.05), (loading_ms, phase)
        steps_ms = value(run, "rankscope_step_duration_seconds_sum", rank) * 1000
        assert sum(phase.values()) == pytest.approx(steps_ms, rel=1e-6)


def test_checkpoints_and_validation_are_their_own(run):
    """The saves (steps 5 and 10, and the last step's) and the validations are goodput's
    checkpoint_save and evaluation, each within 5% of torchtitan's own checkpoint_save and
    eval spans (the save span also covers the steps that wrote nothing: microseconds)."""
    for rank in RANKS:
        spans = run.spans[rank]
        saving = value(run, "rankscope_wall_seconds_total", rank, "checkpoint_save") * 1000
        evaluating = value(run, "rankscope_wall_seconds_total", rank, "evaluation") * 1000
        assert saving == pytest.approx(spans["checkpoint_save"], rel=0.05), (saving, spans)
        assert evaluating == pytest.approx(spans["eval"], rel=0.05), (evaluating, spans)
        assert saving > 0 and evaluating > 0


def test_collective_counts_equal_the_flight_recorders(run):
    """Every collective of every process group, counted as it ran, equals the ring torch's
    flight recorder held when training ended (20,000 entries: torchtitan's default ring)."""
    for rank in RANKS:
        counted = collections.Counter()
        for s in select(run.samples, "rankscope_process_group_collectives_total", rank=rank):
            counted[s.labels["op"]] += int(s.value)
        recorded = run.recorded[rank]
        assert counted == recorded, (rank, counted, recorded)
        assert recorded["all_gather"] > 0


def test_groups_are_named_by_torchtitans_mesh(run):
    groups = {s.labels["group"] for s in select(run.samples, "rankscope_process_group_collectives_total")
              if s.labels.get("op") == "all_gather"}
    assert groups == {"fsdp"} or groups == {"dp_shard"}, groups


def test_a_hang_on_rank_1_pages_naming_rank_1(runs):
    """Rank 1 stops before a forward; rank 0 waits in FSDP's next all-gather. The flight
    recorder's sequence numbers show rank 1 behind its group: RankscopeCollectiveBehind names
    it (within torchtitan's 100 s collective timeout, which would kill the job), and no page
    names rank 0."""
    page = runs["hang"].page
    assert page["alert"]["labels"]["alertname"] in ("RankscopeCollectiveBehind", "RankscopeHangSuspect")
    assert page["alert"]["labels"]["rank"] == HANG_RANK
    assert {rank for _, rank in page["paged"]} == {HANG_RANK}, page["paged"]


def test_rankscope_changes_nothing_torchtitan_computes(runs):
    """The same job (seed 0) without rankscope logs the same loss (mean and max), gradient norm
    and learning rate at every step, bit for bit, on every rank: every update before the last
    step was the same."""
    for rank in RANKS:
        with_rankscope, bare = runs["main"].logged[rank], runs["bare"].logged[rank]
        assert sorted(with_rankscope) == sorted(bare) == list(range(1, STEPS + 1))
        for step in bare:
            for key in ("avg_loss", "max_loss", "grad_norm"):
                assert with_rankscope[step][key] == bare[step][key], (rank, step, key)
            assert with_rankscope[step]["extra"] == bare[step]["extra"], (rank, step)
