"""Real training-loop shapes a new user writes, against rankscope's public API.

Each test runs a small, complete user script from tests/loops/ (plain
``python`` or ``torchrun`` with gloo on 127.0.0.1) against the installed
package, with its own metrics directory and port, and judges what the node
exporter the job auto-started serves, against what the script measured with
its own clock. Each kills everything it started (tests/helpers/userjob.py).

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
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.jobs import value, wait_until
from tests.helpers.userjob import LOOPS, UserJob, wait_for_file

pytestmark = pytest.mark.integration

STEPS = 30
STUCK_STATES = ("stuck", "stuck_in_collective", "frozen", "dead")


def close(a: float | None, b: float, rel: float = 1e-5) -> bool:
    return a is not None and math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


def check(failures: list[str]) -> None:
    assert not failures, "; ".join(failures)


# -- 1. values in the shapes a loop has at hand ---------------------------------

@pytest.mark.parametrize("kind", ["loss_per_sample", "grad_per_group", "lr_list", "loss_text", "grad_dict"])
def test_non_scalar_values_never_break_step_accounting(tmp_path, kind):
    """loss with reduction="none" -> its mean; per-group grad norms -> the total 2-norm; an LR
    list -> the first group's; a string or dict -> a counted drop. Every step counts, and the
    exporter sees the rank progressing (mid-run, after the last step) and then finished."""
    release = tmp_path / "release"
    with UserJob("observe_values.py", kind, str(STEPS), tmp_path=tmp_path, env={"LOOP_HOLD": str(release)}) as job:
        job.start()
        if not wait_for_file(job.out / "holding0", 60):
            pytest.fail(f"the script did not reach its last step; log:\n{job.log()[-3000:]}")

        def settled():
            s = job.scrape()
            return s if job.state(s) == "progressing" and value(s, "rankscope_steps_total", run=job.run_id) == STEPS \
                else None
        try:
            mid = wait_until(settled, timeout=6, what="all steps published, rank progressing")
        except TimeoutError:
            mid = job.scrape()
        release.touch()
        job.wait(60)
        final = job.scrape()
        reported = job.results()[0]["last"]

    run = job.run_id
    f = []
    mid_state, mid_steps = job.state(mid), value(mid, "rankscope_steps_total", run=run)
    if mid_state != "progressing" or mid_steps != STEPS:
        f.append(f"after the last step, before close: state {mid_state!r}, steps_total {mid_steps} "
                 f"(want progressing, {STEPS})")
    steps = value(final, "rankscope_steps_total", run=run)
    count = value(final, "rankscope_step_duration_seconds_count", run=run)
    if steps != STEPS or count != STEPS:
        f.append(f"steps_total {steps}, step_duration_seconds_count {count}, want {STEPS}")
    if job.state(final) != "finished":
        f.append(f"final state {job.state(final)!r}, want finished")
    for state in (job.state(mid), job.state(final)):
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

def _accounting_failures(job: UserJob, samples, result: dict, rank: int = 0) -> list[str]:
    """Step durations add up to the loop's wall time (2%); the data phase is the whole data wait (15%)."""
    run, r = job.run_id, str(rank)
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


@pytest.mark.parametrize("shape", ["inside", "before"])
def test_grad_accumulation_step_time_adds_up(tmp_path, shape):
    """4 micro-batches per step, fetched inside the step (next(it) x4) or before it
    ([next(it) for _ in range(4)]): the steps' durations sum to the loop's wall time and the
    data phase holds every batch's wait."""
    with UserJob("grad_accum.py", shape, "16", "4", "10", tmp_path=tmp_path) as job:
        job.run(90)
        samples = job.scrape()
        result = job.results()[0]
    check(_accounting_failures(job, samples, result))


def test_grad_accumulation_no_sync_under_ddp(tmp_path):
    """model.no_sync() for 3 of 4 micro-batches inside one step, 2 ranks: same accounting on
    both ranks, and the all-reduces of the synchronised micro-batch are timed."""
    with UserJob("grad_accum.py", "no_sync", "16", "4", "10", nproc=2, tmp_path=tmp_path) as job:
        job.run(120)
        samples = job.scrape()
        results = job.results()
    f = []
    if sorted(results) != [0, 1]:
        f.append(f"results from ranks {sorted(results)}")
    for rank, result in sorted(results.items()):
        f += _accounting_failures(job, samples, result, rank)
        count = value(samples, "rankscope_collective_duration_seconds_count", run=job.run_id, rank=str(rank),
                      op="all_reduce")
        if not count:
            f.append(f"rank {rank}: collective_duration_seconds_count{{op=all_reduce}} = {count}, want > 0")
    check(f)


# -- 3. DDP(find_unused_parameters=True) ---------------------------------------------

def test_ddp_find_unused_parameters(tmp_path):
    with UserJob("train.py", "--steps", str(STEPS), "--find-unused-parameters", nproc=2, tmp_path=tmp_path) as job:
        job.run(120)
        samples = job.scrape()
    f = []
    for rank in "01":
        steps = value(samples, "rankscope_steps_total", run=job.run_id, rank=rank)
        if steps != STEPS:
            f.append(f"rank {rank}: steps_total {steps}, want {STEPS}")
        count = value(samples, "rankscope_collective_duration_seconds_count", run=job.run_id, rank=rank,
                      op="all_reduce")
        if not count:
            f.append(f"rank {rank}: collective_duration_seconds_count{{op=all_reduce}} = {count}, want > 0")
        for component in ("step", "collectives"):
            errors = value(samples, "rankscope_telemetry_errors_total", run=job.run_id, rank=rank,
                           component=component)
            if errors:
                f.append(f"rank {rank}: telemetry_errors_total{{component={component}}} = {errors}")
    check(f)


# -- 4. a world of one, no torchrun ------------------------------------------------------

def test_world_size_one_without_torchrun(tmp_path):
    with UserJob("train.py", "--steps", str(STEPS), tmp_path=tmp_path) as job:
        job.run(90)
        samples = job.scrape()
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

@pytest.mark.parametrize("mode", ["float", "list"])
def test_learning_rate_follows_reduce_lr_on_plateau(tmp_path, mode):
    """lr=opt.param_groups[0]["lr"] or lr=sched.get_last_lr(): the exported LR is the
    optimizer's real LR after the scheduler's reductions."""
    with UserJob("plateau.py", mode, str(STEPS), tmp_path=tmp_path) as job:
        job.run(90)
        samples = job.scrape()
        result = job.results()[0]
    assert result["final_lr"] < result["initial_lr"] / 4, "the script's scheduler did not reduce the LR"
    f = []
    lr = value(samples, "rankscope_learning_rate", run=job.run_id)
    if not close(lr, result["final_lr"], 1e-9):
        f.append(f"learning_rate {lr}, the optimizer's LR is {result['final_lr']} "
                 f"(reduced from {result['initial_lr']})")
    steps = value(samples, "rankscope_steps_total", run=job.run_id)
    if steps != result["steps"]:
        f.append(f"steps_total {steps}, want {result['steps']}")
    check(f)


# -- 6. re-runs ---------------------------------------------------------------------------------

def test_rerun_with_same_run_id_starts_from_zero(tmp_path):
    """The same single-process script run twice from one shell, same run id and metrics dir:
    the second run's steps_total is its own count, not the sum of both runs."""
    steps = 150
    job = UserJob("train.py", tmp_path=tmp_path)
    script = f'"{sys.executable}" "{job.script}" --steps {steps}'
    with job:
        job.start(["bash", "-c", f"{script} && {script}; status=$?; echo done; exit $status"])
        job.wait(120)
        samples = job.scrape()
    assert job.log().count(f"rank 0/1: {steps} steps") == 2, job.log()[-2000:]
    got = value(samples, "rankscope_steps_total", run=job.run_id, rank="0")
    assert got == steps, f"second run's steps_total {got}, want {steps} (a sum of both runs would be {2 * steps})"


# -- 7. misuse fails loudly ------------------------------------------------------------------------

def _misuse(tmp_path, check_name: str) -> tuple[UserJob, dict, list]:
    with UserJob("misuse.py", check_name, tmp_path=tmp_path) as job:
        job.run(90)
        samples = job.scrape()
        result = job.results()[0]
    assert "unexpected" not in result, result["unexpected"]["traceback"]
    return job, result, samples


def test_nested_step_raises_usage_error(tmp_path):
    job, result, samples = _misuse(tmp_path, "nested")
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
    steps = value(samples, "rankscope_steps_total", run=job.run_id)
    if steps is None or not result["good_steps"] <= steps <= result["good_steps"] + 1:
        f.append(f"steps_total {steps} after {result['good_steps']} good steps")
    check(f)


def test_second_monitor_while_one_is_open_is_config_error(tmp_path):
    job, result, samples = _misuse(tmp_path, "second")
    err = result["error"]
    f = []
    if err is None:
        f.append("a second Monitor in the same process was created without error")
    else:
        if not (err["type"] == "ConfigError" and err["is_rankscope_config_error"]):
            f.append(f"raised {err['module']}.{err['type']} ({err['message']!r}), want rankscope.ConfigError")
        if job.run_id not in err["message"]:
            f.append(f"message {err['message']!r} does not name the open monitor (run {job.run_id!r})")
    steps = value(samples, "rankscope_steps_total", run=job.run_id)
    if steps != result["good_steps"]:
        f.append(f"the first monitor's steps_total {steps}, want {result['good_steps']}")
    check(f)


def test_new_monitor_after_close_works(tmp_path):
    job, result, samples = _misuse(tmp_path, "reopen")
    assert result["error"] is None, f"a Monitor after close() failed: {result['error']['traceback']}"
    f = []
    for run, want in ((job.run_id, result["first_steps"]), (job.run_id + "-2", result["second_steps"])):
        got = value(samples, "rankscope_steps_total", run=run)
        if got != want:
            f.append(f"run {run}: steps_total {got}, want {want}")
    check(f)


def test_observe_after_step_ended_is_a_counted_late_drop(tmp_path):
    job, result, samples = _misuse(tmp_path, "late")
    f = []
    if result["error"] is not None:
        f.append(f"a late observe() raised {result['error']['type']}: {result['error']['message']}")
    late = value(samples, "rankscope_telemetry_dropped_total", run=job.run_id, what="late_value")
    if not late or late < 1:
        f.append(f"telemetry_dropped_total{{what=late_value}} = {late}, want >= 1")
    for name, metric in (("loss", "rankscope_loss"), ("grad_norm", "rankscope_grad_norm"),
                         ("lr", "rankscope_learning_rate")):
        got = value(samples, metric, run=job.run_id)
        if not close(got, result["last"][name]):
            f.append(f"{metric} = {got}, the last step reported {result['last'][name]:.6g}")
    check(f)


# -- 8. Monitor before init_process_group --------------------------------------------------------

def test_monitor_before_init_process_group_reports_backend(tmp_path):
    with UserJob("train.py", "--steps", "20", "--monitor-before-init", nproc=2, tmp_path=tmp_path) as job:
        job.run(120)
        samples = job.scrape()
    f = []
    for rank in "01":
        info = job.series(samples, "rankscope_rank_info", rank=rank)
        backends = [s.labels.get("backend") for s in info]
        if backends != ["gloo"]:
            f.append(f"rank {rank}: rank_info backend labels {backends}, want exactly one series, 'gloo'")
        steps = value(samples, "rankscope_steps_total", run=job.run_id, rank=rank)
        if steps != 20:
            f.append(f"rank {rank}: steps_total {steps}, want 20")
    check(f)


# -- 9. user metric misuse -------------------------------------------------------------------------

def test_user_metric_misuse(tmp_path):
    """Declaring: a bad name, a duplicated label, a reserved label -> ConfigError at once.
    Setting a label the metric does not have: counted as a telemetry error, never raised."""
    with UserJob("user_metrics.py", tmp_path=tmp_path) as job:
        job.run(90)
        samples = job.scrape()
        result = job.results()[0]
    f = []
    for what in ("bad_name", "duplicate_labels", "pid_label"):
        got = result[what]
        if not (got["raised"] == "ConfigError" and got["is_rankscope_config_error"]):
            f.append(f"{what}: raised {got['raised']} {got.get('message', '')!r}, want rankscope.ConfigError")
    if result["undeclared_label"]["raised"] is not None:
        f.append(f"set(split=...) on a metric without labels raised {result['undeclared_label']}")
    errors = value(samples, "rankscope_telemetry_errors_total", run=job.run_id, component="user")
    if not errors:
        f.append(f"telemetry_errors_total{{component=user}} = {errors} after set() with an undeclared label, want > 0")
    acc = value(samples, "rankscope_user_eval_accuracy_ratio", run=job.run_id)
    if not close(acc, 0.5):
        f.append(f"rankscope_user_eval_accuracy_ratio = {acc}, want 0.5 (the last valid set)")
    check(f)


# -- shadowing: the user's own training/ package and exporter.py ------------------------------------

def test_user_training_package_and_exporter_module_do_not_shadow_rankscope(tmp_path):
    """A project directory with its own `training` package (no Monitor in it) and an
    `exporter.py` model-export script (which writes a marker and exits 1) runs a 2-rank
    torchrun job whose script does `from rankscope import Monitor`: the real exporter serves
    the real series, and the user's exporter.py never runs. No repository on PYTHONPATH."""
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
    with UserJob(project / "train.py", "--steps", "50", nproc=2, tmp_path=tmp_path, cwd=project) as job:
        assert "PYTHONPATH" not in job.environment()
        job.run(120)
        samples = job.scrape()
    f = []
    if marker.exists():
        f.append(f"the user's exporter.py ran: {marker.read_text().strip()}")
    for rank in "01":
        steps = value(samples, "rankscope_steps_total", run=job.run_id, rank=rank)
        if steps != 50:
            f.append(f"rank {rank}: steps_total {steps}, want 50")
    info = [s for s in samples if s.name == "rankscope_exporter_info"]
    if len(info) != 1 or Path(info[0].labels.get("directory", "")).resolve() != job.metrics_dir.resolve():
        f.append(f"rankscope_exporter_info: {[s.labels for s in info]}, want one serving {job.metrics_dir}")
    check(f)
