"""Suite-wide fixtures and the test tiers, one folder each.

    tests/unit/         the fast tier (bash tests/run.sh --fast): unit and static tests, no
                        torchrun job, no exporter process, no Prometheus/Alertmanager server, no
                        other long-running process (short tools such as promtool, amtool or
                        systemd-analyze are fine). A package's tests mirror it:
                        tests/unit/<package>/test_<module>.py (rankscope.step.accounting's in
                        tests/unit/step/); a top-level module's and the static checks of the
                        repository's rules, dashboards, deploy files and docs sit flat
    tests/integration/  real jobs, exporters, Prometheus, Alertmanager, OTLP receivers, browsers
    tests/drills/       whole incidents end to end: the alert drills, a healthy run paging
                        nothing, and the fault matrix (its own tier: bash tests/run.sh --matrix)

Every test outside tests/unit is marked ``integration`` here, so ``-m "not integration"``
is the same tier. The fast tier's rule is enforced at run time: a unit test that starts
one of the project's long-running processes (torchrun / torch.distributed.run, the
trainer, the exporter, Prometheus, Alertmanager, the demo) fails at once, naming the
command, in every run (the full suite included), so a misfiled test breaks CI instead of
slowing the fast tier.
"""

import os
import shlex
import subprocess
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
FAST_TIER = TESTS / "unit"

# Long-running programs: by executable name, by `python -m` module, by script name.
LONG_RUNNING_EXECUTABLES = frozenset({"torchrun", "prometheus", "prometheus-alertmanager", "alertmanager"})
LONG_RUNNING_MODULES = frozenset({"torch.distributed.run", "torch.distributed.launch", "rankscope.train",
                                  "rankscope.exporter", "rankscope.exporter.cli"})
LONG_RUNNING_SCRIPTS = frozenset({"demo.sh"})


def _fast(path) -> bool:
    return FAST_TIER in Path(path).resolve().parents


def pytest_ignore_collect(collection_path, config):
    """With exactly -m "not integration" (the fast tier), do not even import the other tiers."""
    if " ".join(config.getoption("markexpr", "").split()) not in ("not integration", "not integration and not matrix",
                                                                     "not integration and not matrix and not soak"):
        return None
    if collection_path.is_dir():
        inside = collection_path.resolve()
        return None if inside == TESTS or inside == FAST_TIER or FAST_TIER in inside.parents else True
    return None if collection_path.suffix != ".py" or _fast(collection_path) else True


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not _fast(item.path):
            item.add_marker(pytest.mark.integration)


def pytest_collection_finish(session):
    """The promtool tests run in the background from here, beside the Python tests (tests/unit/test_rules.py)."""
    if any(item.name == "test_promtool_unit_tests_pass" for item in session.items):
        from tests.unit.test_rules import start_promtool_tests

        start_promtool_tests()


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
            pytest.fail(f"{item.nodeid} is in the fast tier (tests/unit) but starts {what!r} ({args!r}): "
                        "move it to tests/integration", pytrace=False)
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
