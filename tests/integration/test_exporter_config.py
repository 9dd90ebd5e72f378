"""The exporter's configuration layer and its janitor.

* ``ExporterConfig.from_env``: explicit (command-line) values win over the
  environment, which wins over the defaults written on the dataclass; every
  wrong value names its option or variable; ``0`` is a value, validated, never
  swapped for a default.
* The CLI (real ``python -m rankscope.exporter`` processes): a bad value is one
  error line and exit code 2, at start-up.
* Retention: a scrape never deletes anything; the janitor thread removes a
  run whose ranks have all been gone longer than ``--retention``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from rankscope.contract import environment
from rankscope.contract.environment import DEFAULT_ADDR, DEFAULT_PORT, ConfigError, default_node, setting
from rankscope.contract.rundir import default_metrics_dir, load_registrations
from rankscope.exporter.cli import build_parser, config_from_args
from rankscope.exporter.config import ExporterConfig, ExporterConfigError
from rankscope.exporter.ranks import RankCollector
from tests.helpers.exporter_proc import ExporterProcess, SyntheticRanks
from tests.helpers.jobs import REPO, free_port, scrape_text, wait_until

THRESHOLDS = [  # field, option, variable
    ("stuck_after_s", "--stuck-after", "RANKSCOPE_STUCK_AFTER_S"),
    ("frozen_after_s", "--frozen-after", "RANKSCOPE_FROZEN_AFTER_S"),
    ("suspect_after_s", "--suspect-after", "RANKSCOPE_SUSPECT_AFTER_S"),
]


def from_cli(argv: list[str], env: dict[str, str]) -> ExporterConfig:
    return config_from_args(build_parser().parse_args(argv), env)


# -- precedence ------------------------------------------------------------------


def test_defaults():
    cfg = from_cli([], {})
    assert (cfg.addr, cfg.port, cfg.directory) == (DEFAULT_ADDR, DEFAULT_PORT, default_metrics_dir())
    assert cfg.node == default_node()
    assert (cfg.stuck_after_s, cfg.frozen_after_s, cfg.suspect_after_s) == (30.0, 10.0, 10.0)
    assert (cfg.retention_s, cfg.exit_when_idle_s, cfg.nvml, cfg.web_config) == (900.0, 0.0, True, None)


def test_environment_beats_defaults(tmp_path):
    env = {"RANKSCOPE_METRICS_DIR": str(tmp_path), "RANKSCOPE_METRICS_ADDR": "0.0.0.0",
           "RANKSCOPE_METRICS_PORT": "9500", "RANKSCOPE_NODE": "node7", "RANKSCOPE_STUCK_AFTER_S": "3",
           "RANKSCOPE_FROZEN_AFTER_S": "4", "RANKSCOPE_SUSPECT_AFTER_S": "5"}
    cfg = from_cli([], env)
    assert (cfg.directory, cfg.addr, cfg.port, cfg.node) == (tmp_path, "0.0.0.0", 9500, "node7")
    assert (cfg.stuck_after_s, cfg.frozen_after_s, cfg.suspect_after_s) == (3.0, 4.0, 5.0)


def test_explicit_beats_environment(tmp_path):
    env = {"RANKSCOPE_METRICS_DIR": "/elsewhere", "RANKSCOPE_METRICS_ADDR": "0.0.0.0",
           "RANKSCOPE_METRICS_PORT": "9500", "RANKSCOPE_NODE": "node7", "RANKSCOPE_STUCK_AFTER_S": "soon",
           "RANKSCOPE_FROZEN_AFTER_S": "4", "RANKSCOPE_SUSPECT_AFTER_S": "5"}
    cfg = from_cli(["--dir", str(tmp_path), "--addr", "127.0.0.2", "--port", "9600", "--node", "n1",
                    "--stuck-after", "6", "--frozen-after", "7", "--suspect-after", "8", "--retention", "9",
                    "--exit-when-idle", "10", "--no-nvml"], env)
    assert (cfg.directory, cfg.addr, cfg.port, cfg.node) == (tmp_path, "127.0.0.2", 9600, "n1")
    assert (cfg.stuck_after_s, cfg.frozen_after_s, cfg.suspect_after_s) == (6.0, 7.0, 8.0)
    assert (cfg.retention_s, cfg.exit_when_idle_s, cfg.nvml) == (9.0, 10.0, False)


def test_only_the_documented_variables_are_read():
    """Other RANKSCOPE_* names (the ranks', the Slurm scripts' RANKSCOPE_PORT) are not the exporter's."""
    env = {"RANKSCOPE_PORT": "1", "RANKSCOPE_ADDR": "x", "RANKSCOPE_DIRECTORY": "/x", "RANKSCOPE_RETENTION": "0",
           "RANKSCOPE_NVML": "no", "RANKSCOPE_EXIT_WHEN_IDLE": "-1", "RANKSCOPE_WEB_CONFIG": "/x.yml"}
    assert from_cli([], env) == from_cli([], {})
    # The two an auto-started exporter takes from its job's environment (README, "Run the exporter").
    cfg = from_cli([], {"RANKSCOPE_RETENTION_S": "60", "RANKSCOPE_EXIT_WHEN_IDLE_S": "5"})
    assert (cfg.retention_s, cfg.exit_when_idle_s) == (60.0, 5.0)


def test_rank_side_config_still_reads_rankscope_field_names():
    """A dataclass without setting() metadata keeps RANKSCOPE_<FIELD> (MonitorConfig relies on it)."""
    from rankscope.config import MonitorConfig

    cfg = MonitorConfig.from_env({"RANKSCOPE_METRICS_PORT": "9501", "RANKSCOPE_LOSS_WINDOW": "7"}, run="r")
    assert (cfg.metrics_port, cfg.loss_window, cfg.run) == (9501, 7, "r")


def test_setting_reads_the_first_variable_that_is_set():
    @dataclass(frozen=True)
    class Toy:
        name: str = setting(default="d", env=("A", "B"))
        hidden: str = setting(default="h")

    assert environment.from_env(Toy, {"B": "b", "HIDDEN": "x", "RANKSCOPE_HIDDEN": "x"}) == Toy("b", "h")
    assert environment.from_env(Toy, {"A": "a", "B": "b"}).name == "a"
    assert environment.from_env(Toy, {"A": "", "B": "b"}).name == "b"
    assert environment.from_env(Toy, {"A": "a"}, name="e").name == "e"


# -- errors name the option or the variable ---------------------------------------------


def test_error_class():
    assert issubclass(ExporterConfigError, ConfigError) and issubclass(ExporterConfigError, ValueError)


@pytest.mark.parametrize("field,option,variable", THRESHOLDS)
@pytest.mark.parametrize("value", ["0", "-1"])
def test_threshold_zero_or_negative_is_validated_not_replaced(field, option, variable, value):
    # A valid variable must not stand in for the explicit (bad) value either.
    with pytest.raises(ExporterConfigError, match=f"^{option}: must be > 0"):
        from_cli([option, value], {variable: "5"})
    with pytest.raises(ExporterConfigError, match=f"^{variable}: must be > 0"):
        from_cli([], {variable: value})


@pytest.mark.parametrize("argv,message", [
    (["--retention", "0"], "--retention: must be > 0"),
    (["--exit-when-idle", "-1"], "--exit-when-idle: must be >= 0"),
    (["--port", "0"], "--port: 0 is not a TCP port"),
    (["--port", "65536"], "--port: 65536 is not a TCP port"),
    (["--stuck-after", "nan"], "--stuck-after: must be > 0"),
])
def test_bad_explicit_values_name_their_option(argv, message):
    with pytest.raises(ExporterConfigError) as e:
        from_cli(argv, {})
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("variable,raw,message", [
    ("RANKSCOPE_STUCK_AFTER_S", "soon", "RANKSCOPE_STUCK_AFTER_S='soon' is not a number"),
    ("RANKSCOPE_METRICS_PORT", "http", "RANKSCOPE_METRICS_PORT='http' is not a number"),
    ("RANKSCOPE_METRICS_PORT", "70000", "RANKSCOPE_METRICS_PORT: 70000 is not a TCP port"),
])
def test_bad_variables_name_the_variable(variable, raw, message):
    with pytest.raises(ConfigError) as e:
        from_cli([], {variable: raw})
    assert str(e.value).startswith(message)


def test_directory_that_is_a_file(tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    with pytest.raises(ExporterConfigError, match=f"^--dir: {a_file} exists and is not a directory"):
        from_cli(["--dir", str(a_file)], {})
    with pytest.raises(ExporterConfigError, match=f"^RANKSCOPE_METRICS_DIR: {a_file} exists"):
        from_cli([], {"RANKSCOPE_METRICS_DIR": str(a_file)})


def test_direct_construction_names_the_field(tmp_path):
    """Tests and tools build ExporterConfig directly; the error then names the field."""
    with pytest.raises(ExporterConfigError, match="^retention_s: must be > 0"):
        ExporterConfig(directory=tmp_path, retention_s=0)


# -- the CLI: exit 2, one line, at start-up ---------------------------------------------


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_") and k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(extra)
    return env


CLI_CASES = {
    # name: (args, env, text the one error line starts with after "error: ")
    "stuck-after 0": (["--stuck-after", "0"], {}, "--stuck-after: must be > 0"),
    "frozen-after 0": (["--frozen-after", "0"], {}, "--frozen-after: must be > 0"),
    "suspect-after -1": (["--suspect-after", "-1"], {}, "--suspect-after: must be > 0"),
    "retention 0": (["--retention", "0"], {}, "--retention: must be > 0"),
    "non-numeric env": ([], {"RANKSCOPE_STUCK_AFTER_S": "soon"}, "RANKSCOPE_STUCK_AFTER_S='soon' is not a number"),
    "zero env": ([], {"RANKSCOPE_FROZEN_AFTER_S": "0"}, "RANKSCOPE_FROZEN_AFTER_S: must be > 0"),
    "dir from env below a file": ([], {"RANKSCOPE_METRICS_DIR": "{a_file}/sub"}, "RANKSCOPE_METRICS_DIR: cannot create"),
}


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, float]]:
    """Every CLI case at once (each is an interpreter start; two cores)."""
    a_file = tmp_path_factory.mktemp("cli") / "a-file"
    a_file.write_text("x")
    procs = {}
    for name, (args, env, _) in CLI_CASES.items():
        env = {k: v.format(a_file=a_file) for k, v in env.items()}
        if "RANKSCOPE_METRICS_DIR" not in env:
            args = ["--dir", str(tmp_path_factory.mktemp("m")), *args]
        cmd = [sys.executable, "-m", "rankscope.exporter", "--no-nvml", "--port", str(free_port()), *args]
        procs[name] = (subprocess.Popen(cmd, cwd=REPO, env=_clean_env(**env), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True), time.monotonic())
    results = {}
    for name, (proc, started) in procs.items():
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        results[name] = (subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.monotonic() - started)
    return results


@pytest.mark.parametrize("name", list(CLI_CASES))
def test_cli_bad_value_exits_2_with_one_line(name, cli_results):
    proc, _ = cli_results[name]
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"rankscope-exporter: error: {CLI_CASES[name][2]}"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr


def test_exit_when_idle_still_exits(tmp_path):
    """The janitor loop also carries --exit-when-idle: no rank at all, so it exits within a few seconds."""
    cmd = [sys.executable, "-m", "rankscope.exporter", "--no-nvml", "--port", str(free_port()),
           "--dir", str(tmp_path), "--exit-when-idle", "1"]
    proc = subprocess.run(cmd, cwd=REPO, env=_clean_env(), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and "no rank alive" in proc.stderr, proc.stderr


# -- retention: the janitor deletes, a scrape never does --------------------------------------


def _dead_run(metrics_dir: Path, run: str) -> Path:
    """A run directory whose one registered process has been started, has stepped, and is gone (SIGKILL)."""
    with SyntheticRanks(metrics_dir, n=1, run=run):
        time.sleep(0.3)
    run_dir = metrics_dir / run
    assert [r.process_alive() for r in load_registrations(run_dir)] == [False]
    return run_dir


def _files(directory: Path) -> set[Path]:
    return set(directory.rglob("*"))


def test_a_scrape_deletes_nothing_even_when_expired(tmp_path):
    run_dir = _dead_run(tmp_path, "gone")
    before = _files(tmp_path)
    assert any(p.name.startswith("gauge_live") for p in before)   # the dead process's heartbeat file
    time.sleep(0.2)
    collector = RankCollector(ExporterConfig(directory=tmp_path, retention_s=0.1, nvml=False))
    samples = [s for m in collector.collect() for s in m.samples]
    assert _files(tmp_path) == before
    assert collector.expired_run_dirs(time.time()) == [run_dir]   # expired, yet still there
    assert _files(tmp_path) == before

    def values(name: str) -> list[float]:
        return [s.value for s in samples if s.name == name]

    # A dead process's live gauges are left out of the scrape (not deleted); its counters stay.
    assert values("rankscope_heartbeat_timestamp_seconds") == []
    assert values("rankscope_rank_up") == [0.0]
    assert values("rankscope_steps_total")[0] >= 1


def test_janitor_removes_expired_run_without_a_scrape(tmp_path):
    retention = 5.0
    with ExporterProcess(tmp_path, args=["--retention", str(retention)]) as exporter, \
            SyntheticRanks(tmp_path, n=1, run="live"):
        gone = _dead_run(tmp_path, "gone")
        dead_since = time.time()   # its last heartbeat was earlier: it expires before dead_since + retention
        scrapes = 0
        while time.time() < dead_since + retention - 2:   # before expiry: served, never removed
            assert gone.is_dir()
            assert 'run="gone"' in scrape_text(exporter.url)
            scrapes += 1
            time.sleep(0.3)
        assert scrapes >= 1
        wait_until(lambda: not gone.exists(), timeout=retention + 10, interval=0.2, what="janitor removes the run")
        assert (tmp_path / "live").is_dir(), "a run with a live process is kept"
        assert f"removing {gone}" in exporter.log()
        assert 'run="gone"' not in scrape_text(exporter.url)
