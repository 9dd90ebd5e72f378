"""Bad configuration drill (issue 9, drill 6): every mistake is one clear
line at start-up naming the option, a non-zero exit, and no traceback, for
the exporter (``python -m rankscope.exporter``) and for the trainer
(``python -m rankscope.train``, the process torchrun starts per rank).

The trainer cases are started together (each imports torch, seconds apiece
on a busy 2-core machine) and checked one test each.
"""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.helpers.jobs import REPO, free_port


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANKSCOPE_", "OTEL_")) and k != "PROMETHEUS_MULTIPROC_DIR"}
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


def check_error(proc: subprocess.CompletedProcess, *expected: str) -> None:
    err = proc.stderr
    assert proc.returncode != 0, f"exit 0; stderr: {err}"
    assert "Traceback" not in err and "Traceback" not in proc.stdout, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, f"expected one error line, got: {err}"
    for text in expected:
        assert text in lines[0], f"{text!r} not in {lines[0]!r}"


@pytest.fixture(scope="module")
def busy_port():
    """A port held by a plain listening socket."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture(scope="module")
def foreign_http_port():
    """A port held by an HTTP server that is not a rankscope exporter (404 everywhere)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    server.RequestHandlerClass.log_message = lambda *a: None
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def a_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "not-a-directory"
    path.write_text("x")
    return path


# -- the exporter ---------------------------------------------------------------
def run_exporter(args: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rankscope.exporter", "--no-nvml", *args], cwd=REPO, env=_env(**env),
                          capture_output=True, text=True, timeout=60)


EXPORTER_CASES = {
    # name: (args, env, texts the one error line must contain)
    "malformed port": (["--port", "94o0"], {}, ["--port", "94o0"]),
    "port out of range": (["--port", "70000"], {}, ["--port", "70000"]),
    "unknown option": (["--prot", "9400"], {}, ["--prot"]),
    "non-numeric env": ([], {"RANKSCOPE_STUCK_AFTER_S": "soon"}, ["RANKSCOPE_STUCK_AFTER_S", "soon"]),
    "non-numeric port env": ([], {"RANKSCOPE_METRICS_PORT": "http"}, ["RANKSCOPE_METRICS_PORT"]),
    "negative threshold": (["--frozen-after", "-1"], {}, ["--frozen-after"]),
    "bad bind address": (["--addr", "not-an-address.invalid"], {}, ["--addr", "not-an-address.invalid"]),
    "missing web config": (["--web-config", "/nonexistent/web.yml"], {}, ["--web-config", "/nonexistent/web.yml"]),
    "log level": (["--log-level", "LOUD"], {}, ["--log-level"]),
}


@pytest.mark.parametrize("name", list(EXPORTER_CASES))
def test_exporter_bad_option(name: str, tmp_path: Path):
    """Expectation: one error line naming the option, exit 2, no traceback."""
    args, env, expected = EXPORTER_CASES[name]
    if "--port" not in args:
        args = args + ["--port", str(free_port())] if "RANKSCOPE_METRICS_PORT" not in env else args
    proc = run_exporter(["--dir", str(tmp_path / "m"), *args], **env)
    check_error(proc, *expected)
    assert proc.returncode == 2


def test_exporter_port_in_use(busy_port: int, tmp_path: Path):
    """Expectation: a port someone else holds is named as in use; exit 2."""
    proc = run_exporter(["--dir", str(tmp_path / "m"), "--port", str(busy_port)])
    check_error(proc, "--port", f"127.0.0.1:{busy_port}", "already in use")
    assert proc.returncode == 2


def test_exporter_dir_is_a_file(a_file: Path):
    """Expectation: --dir naming a file is refused at start-up; exit 2."""
    proc = run_exporter(["--dir", str(a_file), "--port", str(free_port())])
    check_error(proc, "--dir", str(a_file), "not a directory")
    assert proc.returncode == 2


def test_exporter_dir_cannot_be_created(a_file: Path):
    """Expectation: a --dir below a file cannot be created; the error says so."""
    proc = run_exporter(["--dir", str(a_file / "sub"), "--port", str(free_port())])
    check_error(proc, "--dir", "cannot create")
    assert proc.returncode == 2


# -- the trainer --------------------------------------------------------------
TRAINER_CASES = {
    # name: (args, env, texts the one error line must contain)
    "malformed port": (["--metrics-port", "94o0"], {}, ["--metrics-port", "94o0"]),
    "port out of range": (["--metrics-port", "0"], {}, ["--metrics-port"]),
    "unknown option": (["--stpes", "5"], {}, ["--stpes"]),
    "non-numeric env": ([], {"RANKSCOPE_PUBLISH_INTERVAL_S": "fast"}, ["RANKSCOPE_PUBLISH_INTERVAL_S", "fast"]),
    "invalid otlp endpoint": ([], {"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4317"},
                              ["OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4317"]),
    "invalid otlp port": ([], {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:43x7"},
                          ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]),
    "metrics dir is a file": ([], {"RANKSCOPE_METRICS_DIR": "{a_file}"}, ["metrics_dir", "{a_file}"]),
    "port held by another service": (["--metrics-port", "{foreign}"], {"RANKSCOPE_EXPORTER": "auto"},
                                     ["metrics_port", "{foreign}", "in use"]),
}


@pytest.fixture(scope="module")
def trainer_results(tmp_path_factory, a_file, foreign_http_port) -> dict[str, subprocess.CompletedProcess]:
    """Run every trainer case at once; each is one ``rankscope.train`` process
    with a one-rank environment. Tracing and the exporter are off unless the
    case is about them, so a bad case cannot start anything that outlives it."""
    fill = {"a_file": str(a_file), "foreign": str(foreign_http_port)}
    procs = {}
    for name, (args, env, _) in TRAINER_CASES.items():
        metrics_dir = tmp_path_factory.mktemp("trainer")
        full_env = _env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(free_port()), RANKSCOPE_METRICS_DIR=str(metrics_dir),
                        RANKSCOPE_EXPORTER="off", OMP_NUM_THREADS="1")
        full_env.update({k: v.format(**fill) for k, v in env.items()})
        cmd = [sys.executable, "-m", "rankscope.train", "--steps", "2", "--workers", "0",
               *[a.format(**fill) for a in args]]
        procs[name] = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True)
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return results


@pytest.mark.parametrize("name", list(TRAINER_CASES))
def test_trainer_bad_option(name: str, trainer_results, a_file: Path, foreign_http_port: int):
    """Expectation: one error line naming the option, exit 2, no traceback,
    before any training (nothing is started)."""
    fill = {"a_file": str(a_file), "foreign": str(foreign_http_port)}
    proc = trainer_results[name]
    check_error(proc, *[t.format(**fill) for t in TRAINER_CASES[name][2]])
    assert proc.returncode == 2
    assert "step " not in proc.stdout
