"""`rankscope top` on a real hang (issue 18): a job of two "nodes" (two torchrun agents on
this machine, each with its own exporter and node name, two ranks each) whose last rank hangs
before the all-reduce of step 30, read from both exporters.

The live screen runs in a real terminal (a private tmux server, read back with
``capture-pane``): the hung rank is marked as the hang suspect, its peers show
`stuck_in_collective` in `all_reduce` with the wait's age, states are coloured,
the keys sort, filter and quit. `--once` prints the same facts as plain text.
A bad URL or an unknown run is one error line and exit 2.
"""

from __future__ import annotations

import io
import os
import re
import shlex
import shutil
import subprocess
import uuid
from pathlib import Path
from urllib.parse import urlparse

import pytest

from prometheus import generate
from tests.helpers.jobs import REPO, TrainJob, free_port, rankscope_command, value, wait_until
from tests.helpers.promstack import PrometheusServer

FAST_STATES = {"RANKSCOPE_STUCK_AFTER_S": "5", "RANKSCOPE_FROZEN_AFTER_S": "4", "RANKSCOPE_SUSPECT_AFTER_S": "5"}
NODES = ("node-a", "node-b")
HUNG_RANK = "3"                    # the trainer's default fault rank: the last, on node-b
WAITING_RANKS = ("0", "1", "2")    # rank 2 waits beside it on node-b, so node-b's exporter names the suspect
NODE_RANKS = {"node-a": {"0", "1"}, "node-b": {"2", "3"}}
ANSI = re.compile(r"\x1b\[[0-9;]*m")
DOCS_TOP_IMAGE = REPO / "docs" / "images" / "top.png"

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (tests/run.sh installs it)")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def table_rows(screen: str) -> dict[str, str]:
    """rank -> its table line (a line whose first word is a rank number)."""
    rows = {}
    for line in ANSI.sub("", screen).splitlines():
        match = re.match(r"^[\s|]*(\d+)\s*\|?\s*\S", line)
        if match:
            rows[match.group(1)] = line
    return rows


def shows_the_hang(screen: str, ranks: set[str] = {"0", "1", "2", "3"}) -> bool:
    """The rows are exactly ``ranks``; the waiting ones are stuck in all_reduce, the hung one is the suspect."""
    rows = table_rows(screen)
    if set(rows) != ranks:
        return False
    waiting_ok = all("stuck_in_collective" in rows[r] and "all_reduce" in rows[r] and "SUSPECT" not in rows[r]
                     for r in WAITING_RANKS if r in ranks)
    hung = rows.get(HUNG_RANK)
    return waiting_ok and (hung is None or ("SUSPECT" in hung and re.search(r"\bstuck\b", hung) is not None
                                            and "all_reduce" not in hung))


class Tmux:
    """A private tmux server (its own socket) running one command in a fixed-size window."""

    def __init__(self, command: list[str], env: dict[str, str], width: int = 200, height: int = 40):
        self.socket = f"rankscope-test-{uuid.uuid4().hex[:8]}"
        self.status_file = Path(f"/tmp/{self.socket}.status")
        shell = shlex.join(command)
        self._run("new-session", "-d", "-s", "top", "-x", str(width), "-y", str(height),
                  f"{shell}; echo $? > {self.status_file}", env=env)

    def _run(self, *args: str, env: dict[str, str] | None = None, check: bool = True) -> str:
        proc = subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, timeout=20, env=env)
        if check and proc.returncode != 0:
            raise RuntimeError(f"tmux {args[0]}: {proc.stderr.strip()}")
        return proc.stdout

    def screen(self, colors: bool = False) -> str:
        return self._run("capture-pane", "-p", *(["-e"] if colors else []), "-t", "top")

    def keys(self, *keys: str) -> None:
        self._run("send-keys", "-t", "top", *keys)

    def alive(self) -> bool:
        return subprocess.run(["tmux", "-L", self.socket, "has-session", "-t", "top"], capture_output=True,
                              timeout=10).returncode == 0

    def close(self) -> None:
        self._run("kill-server", check=False)
        self.status_file.unlink(missing_ok=True)


class TwoNodes:
    """Two torchrun agents acting as two nodes of one job, each with its exporter."""

    def __init__(self, run_id: str):
        rdzv = free_port()
        self.run_id = run_id
        # One thread per rank: two "nodes" share this machine's cores (as in the fault matrix).
        self.jobs = [TrainJob(nproc=2, steps=100_000, run_id=run_id, nodes=(2, i, rdzv),
                              extra_args=["--hang-at", "30", "--step-delay", "0.01"],
                              env={**FAST_STATES, "RANKSCOPE_NODE": node, "OMP_NUM_THREADS": "1"})
                     for i, node in enumerate(NODES)]
        self.urls = [job.url for job in self.jobs]

    def __enter__(self) -> "TwoNodes":
        for job in self.jobs:
            job.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for job in reversed(self.jobs):
            job.__exit__(*exc)

    def scrape(self) -> list:
        return [s for job in self.jobs for s in job.scrape()]


@pytest.fixture(scope="module")
def hung_job():
    with TwoNodes(f"top-hang-{free_port()}") as nodes:
        wait_until(lambda: f"rank {HUNG_RANK}: injected hang" in nodes.jobs[1].log(), timeout=180,
                   what="the injected hang")
        wait_until(lambda: (lambda s: value(s, "rankscope_hang_suspect", rank=HUNG_RANK) == 1
                            and all(value(s, "rankscope_rank_state", rank=r, state="stuck_in_collective") == 1
                                    for r in WAITING_RANKS))(nodes.scrape()),
                   timeout=40, what="the exporters to show the waits and name the suspect")
        yield nodes


def test_live_screen_in_a_terminal_marks_the_suspect_and_the_waiting_ranks(hung_job):
    tmux = Tmux([*rankscope_command(), "top", *hung_job.urls, "--interval", "1"], env=_env())
    try:
        screen = wait_until(lambda: shows_the_hang(tmux.screen()) and tmux.screen(), timeout=30,
                            what="the top screen to show the hang")
        print(screen.rstrip())
        plain = ANSI.sub("", screen)
        assert f"run {hung_job.run_id}" in plain
        assert "4 ranks on 2 nodes" in plain
        assert "hang suspect: rank 3" in plain
        assert re.search(r"ranks: 3 stuck_in_collective, 1 stuck", plain), plain
        for r in WAITING_RANKS:   # the age of the wait is shown, in seconds
            assert re.search(r"all_reduce\s+\d+(\.\d+)?s\b", table_rows(screen)[r]), table_rows(screen)[r]
        coloured = tmux.screen(colors=True)
        suspect_line = next(line for line in coloured.splitlines() if "SUSPECT" in line)
        assert "\x1b[" in suspect_line, "the state and the suspect mark are coloured"

        tmux.keys("c")
        wait_until(lambda: "sorted by comm wait" in tmux.screen(), timeout=10, what="sort by comm wait")
        tmux.keys("l")
        wait_until(lambda: "sorted by step lag" in tmux.screen(), timeout=10, what="sort by step lag")
        tmux.keys("t")
        wait_until(lambda: "sorted by step time" in tmux.screen(), timeout=10, what="sort by step time")
        for node in NODES:   # n: the next node's ranks only
            tmux.keys("n")
            wait_until(lambda: f"node {node}" in tmux.screen() and shows_the_hang(tmux.screen(), NODE_RANKS[node]),
                       timeout=10, what=f"only the ranks of {node}")
        tmux.keys("n")
        wait_until(lambda: "node all" in tmux.screen() and shows_the_hang(tmux.screen()), timeout=10,
                   what="all nodes again")
        tmux.keys("q")
        wait_until(lambda: tmux.status_file.exists(), timeout=10, what="top to quit on q")
        assert tmux.status_file.read_text().strip() == "0"
    finally:
        tmux.close()


def test_once_prints_the_same_facts_as_plain_text(hung_job):
    proc = subprocess.run([*rankscope_command(), "top", *hung_job.urls, "--once", "--run", hung_job.run_id],
                          capture_output=True, text=True, timeout=60, env=_env())
    print(proc.stdout)
    assert proc.returncode == 0, proc.stderr
    assert "\x1b[" not in proc.stdout, "plain text: no escape codes"
    assert shows_the_hang(proc.stdout), proc.stdout
    assert "hang suspect: rank 3" in proc.stdout and "4 ranks on 2 nodes" in proc.stdout
    assert f"run {hung_job.run_id}" in proc.stdout
    # --node: one node's ranks.
    proc = subprocess.run([*rankscope_command(), "top", *hung_job.urls, "--once", "--node", "node-b"],
                          capture_output=True, text=True, timeout=60, env=_env())
    assert proc.returncode == 0 and shows_the_hang(proc.stdout, NODE_RANKS["node-b"]), proc.stdout + proc.stderr
    # No URL: this node's exporter (node-a's here), on the port the ranks were given.
    proc = subprocess.run([*rankscope_command(), "top", "--once"], capture_output=True, text=True, timeout=60,
                          env={**_env(), "RANKSCOPE_METRICS_PORT": str(hung_job.jobs[0].port)})
    assert proc.returncode == 0, proc.stderr
    assert shows_the_hang(proc.stdout, NODE_RANKS["node-a"]) and f"run {hung_job.run_id}" in proc.stdout, proc.stdout


def test_from_prometheus_the_same_facts_and_the_alerts_firing(hung_job, tmp_path):
    """Read through Prometheus (the shipped rules, fast drill thresholds): the same rows, and the
    header lists the HangSuspect page for rank 3; exporter rows with --prometheus get its alerts too."""
    rules_dir = tmp_path / "rules"
    generate.main(["--override", str(REPO / "prometheus" / "fast.yaml"), "--out", str(rules_dir)])
    rules = [rules_dir / generate.RECORDING_FILE, rules_dir / generate.ALERTS_FILE]
    with PrometheusServer(targets=[urlparse(url).netloc for url in hung_job.urls], rule_files=rules) as prom:
        prom.wait_for(lambda: prom.query(f'ALERTS{{alertname="RankscopeHangSuspect",alertstate="firing",'
                                         f'run="{hung_job.run_id}"}}'), timeout=60, what="the HangSuspect alert")
        for args in (["--prometheus", prom.url, "--run", hung_job.run_id],   # rows and alerts from Prometheus
                     ["--prometheus", prom.url, *hung_job.urls]):            # rows from the exporters
            proc = subprocess.run([*rankscope_command(), "top", *args, "--once"], capture_output=True, text=True,
                                  timeout=60, env=_env())
            print(proc.stdout)
            assert proc.returncode == 0, proc.stderr
            assert shows_the_hang(proc.stdout), proc.stdout
            assert re.search(r"alerts firing: .*RankscopeHangSuspect \(critical rank 3\)", proc.stdout), proc.stdout
        if os.environ.get("RANKSCOPE_UPDATE_DOCS_IMAGES") == "1":
            refresh_docs_image(hung_job, prom, tmp_path)


def refresh_docs_image(job: TwoNodes, prom: PrometheusServer, tmp_path: Path) -> None:
    """docs/images/top.png: the live screen of this hang as the terminal shows it (tmux capture with
    colours -> rich's SVG export -> Chromium screenshot, cropped)."""
    from PIL import Image, ImageOps
    from rich.console import Console
    from rich.text import Text

    width = 150
    tmux = Tmux([*rankscope_command(), "top", *job.urls, "--prometheus", prom.url], env=_env(), width=width,
                height=24)
    try:
        wait_until(lambda: "steps/s over" in tmux.screen(), timeout=20, what="a refresh with a window")
        ansi = tmux.screen(colors=True).rstrip()
    finally:
        tmux.close()
    console = Console(record=True, width=width, file=io.StringIO(), color_system="truecolor", force_terminal=True)
    for line in ansi.splitlines():
        console.print(Text.from_ansi(line), overflow="crop", no_wrap=True)
    svg = tmp_path / "top.svg"
    console.save_svg(str(svg), title="rankscope top: two nodes, rank 3 hung before the all-reduce of step 30")
    shot = tmp_path / "top.png"
    subprocess.run([shutil.which("chromium"), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--host-resolver-rules=MAP * ~NOTFOUND", "--window-size=1700,600", f"--screenshot={shot}",
                    svg.as_uri()], capture_output=True, timeout=120, check=True)
    page = Image.open(shot).convert("RGB")
    box = ImageOps.invert(page).getbbox()
    DOCS_TOP_IMAGE.parent.mkdir(parents=True, exist_ok=True)
    page.crop((max(box[0] - 10, 0), max(box[1] - 10, 0), min(box[2] + 10, page.width),
               min(box[3] + 10, page.height))).save(DOCS_TOP_IMAGE, optimize=True)


def check_one_line_error(proc: subprocess.CompletedProcess, *expected: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rankscope: error: "), proc.stderr
    for text in expected:
        assert text in lines[0], (text, lines[0])


def test_bad_url_and_unknown_run_are_one_line_errors(hung_job):
    closed = free_port()
    for args, expected in (
        ([f"127.0.0.1:{closed}"], ("cannot connect",)),
        (["--prometheus", f"http://127.0.0.1:{closed}"], ("cannot connect",)),
        (["ftp://example/metrics"], ("not an http(s) URL",)),
        ([*hung_job.urls, "--run", "no-such-run"], ("no-such-run", "not found", hung_job.run_id)),
        ([*hung_job.urls, "--node", "no-such-node"], ("no-such-node", "node-a, node-b")),
    ):
        proc = subprocess.run([*rankscope_command(), "top", *args, "--once"], capture_output=True, text=True,
                              timeout=60, env=_env())
        check_one_line_error(proc, *expected)
    # The live screen checks its source before it takes the terminal.
    tmux = Tmux([*rankscope_command(), "top", *hung_job.urls, "--run", "no-such-run"], env=_env())
    try:
        wait_until(lambda: tmux.status_file.exists(), timeout=20, what="top to exit")
        assert tmux.status_file.read_text().strip() == "2"
    finally:
        tmux.close()


def test_a_node_whose_exporter_stops_answering_is_named_and_the_others_stay(hung_job):
    """Last in this module: it kills node-b's exporter (the node in trouble)."""
    tmux = Tmux([*rankscope_command(), "top", *hung_job.urls, "--interval", "1"], env=_env())
    try:
        wait_until(lambda: shows_the_hang(tmux.screen()), timeout=30, what="the top screen to show the hang")
        hung_job.jobs[1].health()           # learn node-b's exporter pid
        hung_job.jobs[1]._kill_exporter()
        node_b = urlparse(hung_job.urls[1]).netloc
        screen = wait_until(lambda: (lambda text: "not answering" in text and node_b in text
                                     and shows_the_hang(text, NODE_RANKS["node-a"]) and text)(tmux.screen()),
                            timeout=20, what="node-b named as not answering, node-a's ranks still shown")
        print(screen.rstrip())
        assert tmux.alive(), "a node that stops answering does not end top"
    finally:
        tmux.close()
