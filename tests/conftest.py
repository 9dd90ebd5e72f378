"""Suite-wide fixtures and the two test tiers.

Tiers. The fast tier (``bash tests/run.sh --fast``, i.e. ``pytest -m "not
integration"``) is the unit and static tests: no torchrun jobs, no exporter
process, no Prometheus/Alertmanager server, no other long-running process
(short tools such as promtool, amtool or systemd-analyze are fine). Two rules
keep integration tests out of it:

1. Opt-in by file: a file's tests are in the fast tier only if the file is
   listed in FAST_FILES below; every test of any other file (a new file
   included) is marked ``integration`` here. Inside a listed file, a test that
   needs a real process carries ``@pytest.mark.integration`` itself.
2. Enforced at run time: a test not marked ``integration`` that starts one of
   the project's long-running processes (torchrun / torch.distributed.run, the
   trainer, the exporter, Prometheus, Alertmanager, the demo) fails at once,
   naming the command, in every run (the full suite included), so a misfiled
   test breaks CI instead of slowing the fast tier.
"""

import fnmatch
import os
import shlex
import subprocess
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

# Files (relative to tests/) whose tests are fast unless marked `integration`.
FAST_FILES = frozenset({
    "test_catalog.py",
    "test_collectives_units.py",
    "test_console_units.py",
    "test_dashboards.py",
    "test_flops.py",
    "test_integrations_api.py",
    "test_deploy.py",
    "test_exporter_cardinality.py",
    "test_exporter_compaction.py",
    "test_exporter_reader.py",
    "test_monitor_api.py",
    "test_nvml.py",
    "test_rules.py",
    "test_tracing_unit.py",
    "test_units.py",
})

# Long-running programs: by executable name, by `python -m` module, by script name.
LONG_RUNNING_EXECUTABLES = frozenset({"torchrun", "prometheus", "prometheus-alertmanager", "alertmanager"})
LONG_RUNNING_MODULES = frozenset({"torch.distributed.run", "torch.distributed.launch", "rankscope.train",
                                  "rankscope.exporter", "rankscope.exporter.cli"})
LONG_RUNNING_SCRIPTS = frozenset({"demo.sh"})


def _tests_relative(path) -> str | None:
    try:
        return Path(path).resolve().relative_to(TESTS).as_posix()
    except ValueError:  # outside tests/ (given on the command line)
        return None


def pytest_ignore_collect(collection_path, config):
    """With exactly -m "not integration" (the fast tier), do not even import
    the other files: every test in them is integration (rule 1)."""
    if " ".join(config.getoption("markexpr", "").split()) not in ("not integration", "not integration and not matrix"):
        return None
    if not collection_path.is_file() or collection_path.suffix != ".py":
        return None
    if not any(fnmatch.fnmatch(collection_path.name, pattern) for pattern in config.getini("python_files")):
        return None
    rel = _tests_relative(collection_path)
    return True if rel is not None and rel not in FAST_FILES else None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _tests_relative(item.path) not in FAST_FILES and item.get_closest_marker("integration") is None:
            item.add_marker(pytest.mark.integration)


def long_running(args) -> str | None:
    """What in a Popen argument list makes it a long-running process, or None."""
    argv = shlex.split(args) if isinstance(args, str) else [os.fspath(a) for a in args]
    if not argv:
        return None
    if isinstance(args, str):  # a shell line: look at every word
        words = argv
    else:
        words = argv[:1] + [a for a in argv[1:] if not a.startswith("-")][:1]
    for word in words:
        if Path(word).name in LONG_RUNNING_EXECUTABLES | LONG_RUNNING_SCRIPTS:
            return Path(word).name
    for flag, module in zip(argv, argv[1:]):
        if flag == "-m" and module in LONG_RUNNING_MODULES:
            return f"-m {module}"
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Around a fast test's setup (fixtures of any scope), call and teardown:
    starting a long-running process fails it."""
    if item.get_closest_marker("integration") is not None:
        yield
        return
    original = subprocess.Popen.__init__

    def guarded(self, args, *a, **kw):
        what = long_running(args)
        if what is not None:
            pytest.fail(f"{item.nodeid} is in the fast tier but starts {what!r} ({args!r}): mark it "
                        "@pytest.mark.integration, or move it to a file not in FAST_FILES (tests/conftest.py)",
                        pytrace=False)
        original(self, args, *a, **kw)

    subprocess.Popen.__init__ = guarded
    try:
        yield
    finally:
        subprocess.Popen.__init__ = original


@pytest.fixture(autouse=True)
def _no_leaked_multiproc_dir():
    """An in-process Monitor sets PROMETHEUS_MULTIPROC_DIR (it must stay set for
    prometheus_client); jobs started by later tests would inherit it and refuse
    to start, so each test gets the variable back as it found it."""
    before = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    yield
    if before is None:
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    else:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = before
