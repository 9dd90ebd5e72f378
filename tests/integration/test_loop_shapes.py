"""Real training-loop shapes a new user writes, against rankscope's public API.

Each job runs a small, complete user script from tests/loops/ (plain
``python`` or ``torchrun`` with gloo on 127.0.0.1) against the installed
package, with its own metrics directory and port, and the tests judge what
the node exporter the job auto-started serves, against what the script
measured with its own clock. Every job kills everything it started
(tests/helpers/userjob.py).

A job costs seconds of interpreter, torch import and exporter start, so one
job carries several checks: a script runs its scenarios one after the
other in one process, each as its own run (``<run id>-<scenario>``, its own
Monitor, closed before the next opens), and a 2-rank job carries every check
that a plain 2-rank run can. Each job runs once per module (``JOBS``, on a
JobPool: the two jobs whose checks time the loop to 2% first, each with no
other job beside it, then the rest ``PARALLEL`` at a time, so that one
job's start-up overlaps another's waits), and every test reads the job it
names:

    values   observe_values.py, 5 kinds            test_non_scalar_values_never_break_step_accounting[*]
    accum    grad_accum.py inside,before           test_grad_accumulation_step_time_adds_up[*]
    no_sync  torchrun x2 grad_accum.py no_sync     test_grad_accumulation_no_sync_under_ddp
    ddp      torchrun x2 train.py from a user's project, --find-unused-parameters --monitor-before-init:
             test_ddp_find_unused_parameters, test_monitor_before_init_process_group_reports_backend,
             test_user_training_package_and_exporter_module_do_not_shadow_rankscope
    train    python train.py, twice (same run id)  test_world_size_one_without_torchrun (the first run),
                                                   test_rerun_with_same_run_id_starts_from_zero (the second)
    plateau  plateau.py float,list                 test_learning_rate_follows_reduce_lr_on_plateau[*]
    misuse   misuse.py nested second reopen late   the four misuse tests
    metrics  user_metrics.py                       test_user_metric_misuse

A test fails on its own scenario: a script writes a scenario's results
once that scenario's monitor is closed, so one that stopped early fails the
scenario it stopped in and those after it (a failing exit status, the last
one), each with the job's log.

The checks follow the behaviour contract of the rank side: non-scalar
values never break step accounting; step time adds up to the loop's wall
time under gradient accumulation; DDP's unusual modes work; a world of one
needs no torchrun; the exported LR follows the scheduler; a re-run starts
from zero; misuse fails loudly (or is counted, where raising would break
the loop); the user's own ``training`` package and ``exporter.py`` shadow
nothing.
"""

from __future__ import annotations

import math
import shutil
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.samples import Sample

from tests.helpers.jobs import value, wait_until
from tests.helpers.userjob import LOOPS, JobPool, UserJob

pytestmark = pytest.mark.integration

STEPS = 30
STUCK_STATES = ("stuck", "stuck_in_collective", "frozen", "dead")
PARALLEL = 3
KINDS = ["loss_per_sample", "grad_per_group", "lr_list", "loss_text", "grad_dict"]
ACCUM_SHAPES = ["inside", "before"]
PLATEAU_MODES = ["float", "list"]
MISUSE_CHECKS = ["nested", "second", "reopen", "late"]


def close(a: float | None, b: float, rel: float = 1e-5) -> bool:
    return a is not None and math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


def check(failures: list[str]) -> None:
    assert not failures, "; ".join(failures)


# -- the jobs ----------------------------------------------------------------------

@dataclass
class Ran:
    """A job, once it has ended: the UserJob (run id, results, log), what the exporter served at the
    points the job scraped it (by name), each launch's exit status, and the script's scenarios in the
    order it runs them."""

    job: UserJob
    scenarios: list[str] = field(default_factory=list)
    exit_codes: list[int] = field(default_factory=list)
    scrapes: dict[str, list[Sample]] = field(default_factory=dict)
    scrape_errors: dict[str, str] = field(default_factory=dict)
    notes: dict = field(default_factory=dict)

    # -- in the job (on a JobPool thread) --------------------------------------------
    def launch(self, timeout: float) -> int:
        rc = self.job.run(timeout, check=False)
        self.exit_codes.append(rc)
        return rc

    def scrape(self, name: str) -> None:
        """What the exporter serves now, as ``name``; a scrape that fails is kept for the test to report."""
        try:
            self.scrapes[name] = self.job.scrape()
        except Exception as e:
            self.scrape_errors[name] = f"{type(e).__name__}: {e}"

    # -- in the tests -------------------------------------------------------------------
    def run(self, scenario: str | None = None) -> str:
        """The run id of a scenario (its own Monitor's run)."""
        return self.job.run_id if scenario is None else f"{self.job.run_id}-{scenario}"

    def failed(self, what: str) -> None:
        pytest.fail(f"{what}; exit status {self.exit_codes}; log ({self.job.log_path}):\n{self.job.log()[-3000:]}")

    def samples(self, name: str = "final") -> list[Sample]:
        if name not in self.scrapes:
            self.failed(f"{self.job.script.name}: the exporter could not be scraped ({name}): "
                        f"{self.scrape_errors.get(name, 'the job ended before')}")
        return self.scrapes[name]

    def require_clean(self) -> None:
        if not self.exit_codes or any(self.exit_codes):
            self.failed(f"{self.job.script.name} did not run to its end")

    def results(self, scenario: str | None = None) -> dict[int, dict]:
        """What the ranks wrote about ``scenario``. The scripts write it once the scenario's monitor is
        closed; the last scenario (or the only one) also needs the script to have exited 0."""
        got = self.job.results(scenario)
        last = scenario is None or scenario == self.scenarios[-1]
        if not got or (last and (not self.exit_codes or any(self.exit_codes))):
            self.failed(f"{self.job.script.name} did not get through {scenario or 'its run'} "
                        f"(results from ranks {sorted(got)})")
        return got

    def result(self, scenario: str | None = None) -> dict:
        return self.results(scenario)[0]


def values_job(tmp_path: Path) -> Ran:
    """observe_values.py, every kind: held after each run's last step (before its close) to scrape it mid-run."""
    release = tmp_path / "release"
    release.mkdir()
    with UserJob("observe_values.py", *KINDS, "--steps", str(STEPS), tmp_path=tmp_path,
                 env={"LOOP_HOLD": str(release)}) as job:
        ran = Ran(job, KINDS)
        job.start()
        for kind in KINDS:
            if not job.wait_for_file(job.out / kind / "holding0", 60):
                break
            run = f"{job.run_id}-{kind}"

            def settled():
                s = job.scrape()
                return s if job.state(s, run=run) == "progressing" \
                    and value(s, "rankscope_steps_total", run=run) == STEPS else None
            try:
                ran.scrapes[f"mid {kind}"] = wait_until(settled, timeout=6,
                                                        what="all steps published, rank progressing")
            except TimeoutError:
                ran.scrape(f"mid {kind}")
            (release / kind).touch()
        for kind in KINDS:
            (release / kind).touch()
        ran.exit_codes.append(job.wait(60, check=False))
        ran.scrape("final")
    return ran


def accum_job(tmp_path: Path) -> Ran:
    """grad_accum.py inside,before: 16 steps of 4 micro-batches, 10 ms per batch, one process."""
    with UserJob("grad_accum.py", ",".join(ACCUM_SHAPES), "16", "4", "10", tmp_path=tmp_path) as job:
        ran = Ran(job, ACCUM_SHAPES)
        ran.launch(90)
        ran.scrape("final")
    return ran


def no_sync_job(tmp_path: Path) -> Ran:
    with UserJob("grad_accum.py", "no_sync", "16", "4", "10", nproc=2, tmp_path=tmp_path) as job:
        ran = Ran(job, ["no_sync"])
        ran.launch(120)
        ran.scrape("final")
    return ran


def ddp_job(tmp_path: Path) -> Ran:
    """A 2-rank torchrun job of train.py from a user's project directory that holds its own `training`
    package (no Monitor in it) and an `exporter.py` model-export script (which writes a marker and exits
    1), with DDP(find_unused_parameters=True) and the Monitor created before init_process_group. No
    repository on PYTHONPATH."""
    project = tmp_path / "project"
    (project / "training").mkdir(parents=True)
    (project / "training" / "__init__.py").write_text(textwrap.dedent('''\
        """Our lab's training utilities."""
        SEED = 1234


        def set_seed(seed=SEED):
            import random
            random.seed(seed)
    '''))
    marker = tmp_path / "user-exporter-ran"
    (project / "exporter.py").write_text(textwrap.dedent(f'''\
        """Export the trained model to ONNX (the user's own script)."""
        import sys
        from pathlib import Path

        Path({str(marker)!r}).write_text("exporter.py was imported or run\\n")
        sys.exit(1)
    '''))
    shutil.copy(LOOPS / "train.py", project / "train.py")
    with UserJob(project / "train.py", "--steps", str(STEPS), "--find-unused-parameters", "--monitor-before-init",
                 nproc=2, tmp_path=tmp_path, cwd=project) as job:
        env = job.environment()
        ran = Ran(job, notes={"marker": marker, "pythonpath": env["PYTHONPATH"] if "PYTHONPATH" in env else None})
        ran.launch(120)
        ran.scrape("final")
    return ran


def train_job(tmp_path: Path) -> Ran:
    """python train.py (a world of one, no torchrun), then the same command again from the same shell
    environment: same run id, metrics directory and exporter. Scraped after each run."""
    with UserJob("train.py", "--steps", str(STEPS), tmp_path=tmp_path) as job:
        ran = Ran(job)
        if ran.launch(90) == 0:
            ran.scrape("first")
            ran.launch(90)
            ran.scrape("second")
    return ran


def plateau_job(tmp_path: Path) -> Ran:
    with UserJob("plateau.py", ",".join(PLATEAU_MODES), str(STEPS), tmp_path=tmp_path) as job:
        ran = Ran(job, PLATEAU_MODES)
        ran.launch(90)
        ran.scrape("final")
    return ran


def misuse_job(tmp_path: Path) -> Ran:
    with UserJob("misuse.py", *MISUSE_CHECKS, tmp_path=tmp_path) as job:
        ran = Ran(job, MISUSE_CHECKS)
        ran.launch(90)
        ran.scrape("final")
    return ran


def metrics_job(tmp_path: Path) -> Ran:
    with UserJob("user_metrics.py", tmp_path=tmp_path) as job:
        ran = Ran(job)
        ran.launch(90)
        ran.scrape("final")
    return ran


# fixture name -> the job, started in this order: first, one at a time and with no other job beside
# them, those that time the loop to 2% (ALONE: a rank that waits for the CPU between two steps loses
# time that no step counts, and other jobs' start-up is all CPU); then the rest, PARALLEL at a time.
JOBS = {"accum": accum_job, "no_sync": no_sync_job, "ddp": ddp_job, "values": values_job, "train": train_job,
        "misuse": misuse_job, "plateau": plateau_job, "metrics": metrics_job}
ALONE = {"accum", "no_sync"}


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    """Starts every job that a selected test of this module reads, in the order of JOBS."""
    wanted = {name for item in request.session.items if item.module is request.module
              for name in item.fixturenames if name in JOBS}
    with JobPool(PARALLEL) as pool:
        for name, job in JOBS.items():
            if name in wanted:
                pool.submit(name, job, tmp_path_factory.mktemp(name), alone=name in ALONE)
        yield pool


@pytest.fixture(scope="module")
def values(jobs) -> Ran:
    return jobs.get("values")


@pytest.fixture(scope="module")
def accum(jobs) -> Ran:
    return jobs.get("accum")


@pytest.fixture(scope="module")
def no_sync(jobs) -> Ran:
    return jobs.get("no_sync")


@pytest.fixture(scope="module")
def ddp(jobs) -> Ran:
    return jobs.get("ddp")


@pytest.fixture(scope="module")
def train(jobs) -> Ran:
    return jobs.get("train")


@pytest.fixture(scope="module")
def plateau(jobs) -> Ran:
    return jobs.get("plateau")


@pytest.fixture(scope="module")
def misuse(jobs) -> Ran:
    return jobs.get("misuse")


@pytest.fixture(scope="module")
def metrics(jobs) -> Ran:
    return jobs.get("metrics")


# -- 1. values in the shapes a loop has at hand ---------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_non_scalar_values_never_break_step_accounting(values, kind):
    """loss with reduction="none" -> its mean; per-group grad norms -> the total 2-norm; an LR
    list -> the first group's; a string or dict -> a counted drop. Every step counts, and the
    exporter sees the rank progressing (mid-run, after the last step) and then finished."""
    reported = values.result(kind)["last"]
    job, run = values.job, values.run(kind)
    mid, final = values.samples(f"mid {kind}"), values.samples("final")
    f = []
    mid_state, mid_steps = job.state(mid, run=run), value(mid, "rankscope_steps_total", run=run)
    if mid_state != "progressing" or mid_steps != STEPS:
        f.append(f"after the last step, before close: state {mid_state!r}, steps_total {mid_steps} "
                 f"(want progressing, {STEPS})")
    steps = value(final, "rankscope_steps_total", run=run)
    count = value(final, "rankscope_step_duration_seconds_count", run=run)
    if steps != STEPS or count != STEPS:
        f.append(f"steps_total {steps}, step_duration_seconds_count {count}, want {STEPS}")
    if job.state(final, run=run) != "finished":
        f.append(f"final state {job.state(final, run=run)!r}, want finished")
    for state in (job.state(mid, run=run), job.state(final, run=run)):
        if state in STUCK_STATES:
            f.append(f"exporter reported the rank {state}")
    step_errors = value(final, "rankscope_telemetry_errors_total", run=run, component="step")
    if step_errors:
        f.append(f"telemetry_errors_total{{component=step}} = {step_errors}")
    for name, metric in (("loss", "rankscope_loss"), ("grad_norm", "rankscope_grad_norm"),
                         ("lr", "rankscope_learning_rate")):
        if name in reported:
            got = value(final, metric, run=run)
            if not close(got, reported[name]):
                f.append(f"{metric} = {got}, want {reported[name]:.6g}")
    dropped = value(final, "rankscope_telemetry_dropped_total", run=run, what="value")
    want_dropped = STEPS * reported.get("unreadable_per_step", 0)
    if (dropped or 0) != want_dropped or (want_dropped and dropped is None):
        f.append(f"telemetry_dropped_total{{what=value}} = {dropped}, want {want_dropped}")
    check(f)


# -- 2. gradient accumulation -----------------------------------------------------

def _accounting_failures(samples, run: str, result: dict, rank: int = 0) -> list[str]:
    """Step durations add up to the loop's wall time (2%); the data phase is the whole data wait (15%)."""
    r = str(rank)
    f = []
    steps = value(samples, "rankscope_steps_total", run=run, rank=r)
    if steps != result["steps"]:
        f.append(f"rank {rank}: steps_total {steps}, want {result['steps']}")
    total = value(samples, "rankscope_step_duration_seconds_sum", run=run, rank=r)
    wall = result["wall_s"]
    if total is None or abs(total - wall) > 0.02 * wall:
        f.append(f"rank {rank}: step_duration_seconds_sum {total if total is None else round(total, 4)} s, "
                 f"loop wall time {wall:.4f} s (want within 2%)")
    data = value(samples, "rankscope_phase_seconds_total", run=run, rank=r, phase="data")
    waited, nominal = result["data_wait_s"], result["batches"] * result["sleep_s"]
    if data is None or abs(data - waited) > 0.15 * waited or data < 0.85 * nominal:
        f.append(f"rank {rank}: phase data {data if data is None else round(data, 4)} s, the loop waited "
                 f"{waited:.4f} s for {result['batches']} batches of {result['sleep_s'] * 1000:.0f} ms "
                 f"(want within 15%)")
    return f


@pytest.mark.parametrize("shape", ACCUM_SHAPES)
def test_grad_accumulation_step_time_adds_up(accum, shape):
    """4 micro-batches per step, fetched inside the step (next(it) x4) or before it
    ([next(it) for _ in range(4)]): the steps' durations sum to the loop's wall time and the
    data phase holds every batch's wait."""
    result = accum.result(shape)
    check(_accounting_failures(accum.samples("final"), accum.run(shape), result))


def test_grad_accumulation_no_sync_under_ddp(no_sync):
    """model.no_sync() for 3 of 4 micro-batches inside one step, 2 ranks: same accounting on
    both ranks, and the all-reduces of the synchronised micro-batch are timed."""
    results = no_sync.results("no_sync")
    samples, run = no_sync.samples("final"), no_sync.run("no_sync")
    f = []
    if sorted(results) != [0, 1]:
        f.append(f"results from ranks {sorted(results)}")
    for rank, result in sorted(results.items()):
        f += _accounting_failures(samples, run, result, rank)
        count = value(samples, "rankscope_collective_duration_seconds_count", run=run, rank=str(rank),
                      op="all_reduce")
        if not count:
            f.append(f"rank {rank}: collective_duration_seconds_count{{op=all_reduce}} = {count}, want > 0")
    check(f)


# -- 3. DDP(find_unused_parameters=True) ---------------------------------------------

def test_ddp_find_unused_parameters(ddp):
    ddp.require_clean()
    samples, run = ddp.samples("final"), ddp.run()
    f = []
    for rank in "01":
        steps = value(samples, "rankscope_steps_total", run=run, rank=rank)
        if steps != STEPS:
            f.append(f"rank {rank}: steps_total {steps}, want {STEPS}")
        count = value(samples, "rankscope_collective_duration_seconds_count", run=run, rank=rank,
                      op="all_reduce")
        if not count:
            f.append(f"rank {rank}: collective_duration_seconds_count{{op=all_reduce}} = {count}, want > 0")
        for component in ("step", "collectives"):
            errors = value(samples, "rankscope_telemetry_errors_total", run=run, rank=rank, component=component)
            if errors:
                f.append(f"rank {rank}: telemetry_errors_total{{component={component}}} = {errors}")
    check(f)


# -- 4. a world of one, no torchrun ------------------------------------------------------

def test_world_size_one_without_torchrun(train):
    if train.exit_codes[:1] != [0]:
        train.failed("python train.py (no torchrun) did not run to its end")
    samples, job = train.samples("first"), train.job
    f = []
    steps = value(samples, "rankscope_steps_total", run=job.run_id, rank="0")
    if steps != STEPS:
        f.append(f"steps_total {steps}, want {STEPS}")
    info = job.series(samples, "rankscope_rank_info", rank="0")
    if len(info) != 1 or info[0].labels.get("world_size") != "1":
        f.append(f"rank_info: {[s.labels for s in info]}, want one series with world_size 1")
    if job.state(samples) != "finished":
        f.append(f"state {job.state(samples)!r}, want finished")
    check(f)


# -- 5. ReduceLROnPlateau -------------------------------------------------------------------

@pytest.mark.parametrize("mode", PLATEAU_MODES)
def test_learning_rate_follows_reduce_lr_on_plateau(plateau, mode):
    """lr=opt.param_groups[0]["lr"] or lr=sched.get_last_lr(): the exported LR is the
    optimizer's real LR after the scheduler's reductions."""
    result = plateau.result(mode)
    samples, run = plateau.samples("final"), plateau.run(mode)
    assert result["final_lr"] < result["initial_lr"] / 4, "the script's scheduler did not reduce the LR"
    f = []
    lr = value(samples, "rankscope_learning_rate", run=run)
    if not close(lr, result["final_lr"], 1e-9):
        f.append(f"learning_rate {lr}, the optimizer's LR is {result['final_lr']} "
                 f"(reduced from {result['initial_lr']})")
    steps = value(samples, "rankscope_steps_total", run=run)
    if steps != result["steps"]:
        f.append(f"steps_total {steps}, want {result['steps']}")
    check(f)


# -- 6. re-runs ---------------------------------------------------------------------------------

def test_rerun_with_same_run_id_starts_from_zero(train):
    """The same single-process script run twice, one after the other, same environment (run id,
    metrics dir, exporter): the second run's steps_total is its own count, not the sum of both runs."""
    if train.exit_codes != [0, 0]:
        train.failed("python train.py, run twice, did not run to its end both times")
    job = train.job
    assert job.log().count(f"rank 0/1: {STEPS} steps") == 2, job.log()[-2000:]
    got = value(train.samples("second"), "rankscope_steps_total", run=job.run_id, rank="0")
    assert got == STEPS, f"second run's steps_total {got}, want {STEPS} (a sum of both runs would be {2 * STEPS})"


# -- 7. misuse fails loudly ------------------------------------------------------------------------

def _misuse(misuse: Ran, check_name: str) -> tuple[dict, list]:
    result = misuse.result(check_name)
    assert "unexpected" not in result, result["unexpected"]["traceback"]
    return result, misuse.samples("final")


def test_nested_step_raises_usage_error(misuse):
    result, samples = _misuse(misuse, "nested")
    err = result["error"]
    f = []
    if err is None:
        f.append("no error raised by a step nested in another step")
    else:
        if not (err["type"] == "UsageError" and err["is_rankscope_usage_error"] and err["is_runtime_error"]):
            f.append(f"raised {err['module']}.{err['type']} ({err['message']!r}), want rankscope.UsageError "
                     "(a RuntimeError)")
        if "nest" not in err["message"].lower():
            f.append(f"message {err['message']!r} does not name the nesting")
    if result["inner_body_ran"]:
        f.append("the inner step's body ran: the error must come from entering the inner step")
    steps = value(samples, "rankscope_steps_total", run=misuse.run("nested"))
    if steps is None or not result["good_steps"] <= steps <= result["good_steps"] + 1:
        f.append(f"steps_total {steps} after {result['good_steps']} good steps")
    check(f)


def test_second_monitor_while_one_is_open_is_config_error(misuse):
    result, samples = _misuse(misuse, "second")
    run = misuse.run()   # both monitors on the run of RANKSCOPE_RUN
    err = result["error"]
    f = []
    if err is None:
        f.append("a second Monitor in the same process was created without error")
    else:
        if not (err["type"] == "ConfigError" and err["is_rankscope_config_error"]):
            f.append(f"raised {err['module']}.{err['type']} ({err['message']!r}), want rankscope.ConfigError")
        if run not in err["message"]:
            f.append(f"message {err['message']!r} does not name the open monitor (run {run!r})")
    steps = value(samples, "rankscope_steps_total", run=run)
    if steps != result["good_steps"]:
        f.append(f"the first monitor's steps_total {steps}, want {result['good_steps']}")
    check(f)


def test_new_monitor_after_close_works(misuse):
    result, samples = _misuse(misuse, "reopen")
    assert result["error"] is None, f"a Monitor after close() failed: {result['error']['traceback']}"
    f = []
    first = misuse.run("reopen")
    for run, want in ((first, result["first_steps"]), (first + "-2", result["second_steps"])):
        got = value(samples, "rankscope_steps_total", run=run)
        if got != want:
            f.append(f"run {run}: steps_total {got}, want {want}")
    check(f)


def test_observe_after_step_ended_is_a_counted_late_drop(misuse):
    result, samples = _misuse(misuse, "late")
    run = misuse.run("late")
    f = []
    if result["error"] is not None:
        f.append(f"a late observe() raised {result['error']['type']}: {result['error']['message']}")
    late = value(samples, "rankscope_telemetry_dropped_total", run=run, what="late_value")
    if not late or late < 1:
        f.append(f"telemetry_dropped_total{{what=late_value}} = {late}, want >= 1")
    for name, metric in (("loss", "rankscope_loss"), ("grad_norm", "rankscope_grad_norm"),
                         ("lr", "rankscope_learning_rate")):
        got = value(samples, metric, run=run)
        if not close(got, result["last"][name]):
            f.append(f"{metric} = {got}, the last step reported {result['last'][name]:.6g}")
    check(f)


# -- 8. Monitor before init_process_group --------------------------------------------------------

def test_monitor_before_init_process_group_reports_backend(ddp):
    ddp.require_clean()
    samples, job = ddp.samples("final"), ddp.job
    f = []
    for rank in "01":
        info = job.series(samples, "rankscope_rank_info", rank=rank)
        backends = [s.labels.get("backend") for s in info]
        if backends != ["gloo"]:
            f.append(f"rank {rank}: rank_info backend labels {backends}, want exactly one series, 'gloo'")
        steps = value(samples, "rankscope_steps_total", run=job.run_id, rank=rank)
        if steps != STEPS:
            f.append(f"rank {rank}: steps_total {steps}, want {STEPS}")
    check(f)


# -- 9. user metric misuse -------------------------------------------------------------------------

def test_user_metric_misuse(metrics):
    """Declaring: a bad name, a duplicated label, a reserved label -> ConfigError at once.
    Setting a label the metric does not have: counted as a telemetry error, never raised."""
    result = metrics.result()
    samples, run = metrics.samples("final"), metrics.run()
    f = []
    for what in ("bad_name", "duplicate_labels", "pid_label"):
        got = result[what]
        if not (got["raised"] == "ConfigError" and got["is_rankscope_config_error"]):
            f.append(f"{what}: raised {got['raised']} {got.get('message', '')!r}, want rankscope.ConfigError")
    if result["undeclared_label"]["raised"] is not None:
        f.append(f"set(split=...) on a metric without labels raised {result['undeclared_label']}")
    errors = value(samples, "rankscope_telemetry_errors_total", run=run, component="user")
    if not errors:
        f.append(f"telemetry_errors_total{{component=user}} = {errors} after set() with an undeclared label, want > 0")
    acc = value(samples, "rankscope_user_eval_accuracy_ratio", run=run)
    if not close(acc, 0.5):
        f.append(f"rankscope_user_eval_accuracy_ratio = {acc}, want 0.5 (the last valid set)")
    check(f)


# -- shadowing: the user's own training/ package and exporter.py ------------------------------------

def test_user_training_package_and_exporter_module_do_not_shadow_rankscope(ddp):
    """A project directory with its own `training` package (no Monitor in it) and an
    `exporter.py` model-export script (which writes a marker and exits 1) runs a 2-rank
    torchrun job whose script does `from rankscope import Monitor`: the real exporter serves
    the real series, and the user's exporter.py never runs. No repository on PYTHONPATH."""
    assert ddp.notes["pythonpath"] is None, f"the job ran with PYTHONPATH={ddp.notes['pythonpath']!r}, want none"
    ddp.require_clean()
    samples, job, marker = ddp.samples("final"), ddp.job, ddp.notes["marker"]
    f = []
    if marker.exists():
        f.append(f"the user's exporter.py ran: {marker.read_text().strip()}")
    for rank in "01":
        steps = value(samples, "rankscope_steps_total", run=job.run_id, rank=rank)
        if steps != STEPS:
            f.append(f"rank {rank}: steps_total {steps}, want {STEPS}")
    info = [s for s in samples if s.name == "rankscope_exporter_info"]
    if len(info) != 1 or Path(info[0].labels.get("directory", "")).resolve() != job.metrics_dir.resolve():
        f.append(f"rankscope_exporter_info: {[s.labels for s in info]}, want one serving {job.metrics_dir}")
    check(f)
