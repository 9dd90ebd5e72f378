"""`rankscope report` of a real run with a straggler (issue 18).

A 2-rank job whose rank 1 sleeps ``SLOW_S`` in every forward pass
(``--slow-rank-delay``) is scraped by Debian's Prometheus with the shipped
rules rendered with the fast drill thresholds (prometheus/fast.yaml), so the
Straggler alert fires and lands in the report's timeline. Once the run has
finished, ``rankscope report`` writes the HTML file and a PNG per plot; the
test reads the facts the page embeds, checks that every plot has data and that
rank 1 heads the straggler ranking, and renders the page with headless
Chromium (Debian's ``chromium``) with name resolution off, so a page that
needed the network would show it.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import struct
import subprocess
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

from tests.helpers.jobs import REPO, TrainJob, free_port, rankscope_command
from tests.helpers.paging import render_rules
from tests.helpers.promstack import PrometheusServer

DOCS_IMAGE = REPO / "docs" / "images" / "report.png"
SLOW_RANK = 1
SLOW_S = "0.1"
STEPS = 260            # ~0.12 s a step with the straggler: ~30 s of training, long enough for the Straggler alert
PLOTS = ("step_time_heatmap", "phase_breakdown", "straggler_ranking", "loss", "memory", "collective_latency",
         "alerts_timeline")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """Run the job under Prometheus, then write the report; yields (facts, html path, png dir, prometheus, job)."""
    rules = render_rules(tmp_path_factory.mktemp("fast-rules"), fast=True)
    out = tmp_path_factory.mktemp("report")
    with TrainJob(nproc=2, steps=STEPS, extra_args=["--slow-rank-delay", SLOW_S, "--fault-rank", str(SLOW_RANK)]) as job:
        job.wait_for(lambda samples: True, timeout=180, what="the node exporter to answer")
        with PrometheusServer(targets=[urlparse(job.url).netloc], rule_files=rules) as prom:
            prom.wait_for_scrape(timeout=30)
            assert job.wait(timeout=240) == 0, job.log()[-3000:]
            # The finished states reach Prometheus (the exporter keeps serving the finished run).
            prom.wait_for(lambda: len(prom.query(f'rankscope_rank_state{{run="{job.run_id}",state="finished"}} == 1'))
                          == 2, timeout=30, what="both ranks finished in Prometheus")
            html = out / "report.html"
            started = time.monotonic()
            proc = subprocess.run([*rankscope_command(), "report", "--prometheus", prom.url, "--run", job.run_id,
                                   "--out", str(html), "--png-dir", str(out / "png")],
                                  capture_output=True, text=True, timeout=180, env=_env())
            print(f"rankscope report took {time.monotonic() - started:.1f} s")
            assert proc.returncode == 0, proc.stdout + proc.stderr
            text = html.read_text()
            blob = re.search(r"<script type='application/json' id='rankscope-report'>(.*?)</script>", text, re.S)
            facts = json.loads(blob.group(1).replace("<\\/", "</"))
            yield facts, html, out / "png", prom, job


def test_straggler_ranking_puts_the_slow_rank_first(report):
    facts = report[0]
    ranking = facts["straggler_ranking"]
    print(json.dumps(ranking, indent=1))
    assert [r["rank"] for r in ranking][0] == SLOW_RANK
    assert len(ranking) == 2
    # Its compute per step is about SLOW_S above its peer's.
    excess_s = ranking[0]["compute_per_step_s"] - ranking[1]["compute_per_step_s"]
    assert excess_s > 0.5 * float(SLOW_S), ranking
    assert facts["summary"]["slowest_rank"] == SLOW_RANK
    assert facts["summary"]["ranks"] == 2
    assert facts["summary"]["final_states"] == {"0": "finished", "1": "finished"}
    assert facts["summary"]["steps"] > 0.5 * STEPS   # Prometheus's first scrape comes ~5 s after its start
    assert 0 < facts["summary"]["goodput"] <= 1   # productive over wall seconds (once: never shown)


def test_every_plot_has_data_and_the_page_is_self_contained(report):
    facts, html, png_dir, _, _ = report
    print(json.dumps(facts["plots"], indent=1))
    assert set(facts["plots"]) == set(PLOTS)
    for name in PLOTS:
        assert facts["plots"][name]["points"] > 0, f"plot {name} has no data"
        width, height = png_size((png_dir / f"{name}.png").read_bytes())
        assert width > 400 and height > 150
    text = html.read_text()
    images = re.findall(r"<img [^>]*src='([^']*)'", text)
    assert len(images) == len(PLOTS)
    for src in images:
        assert src.startswith("data:image/png;base64,")
        png_size(base64.b64decode(src.split(",", 1)[1]))
    assert not re.search(r"""(src|href)\s*=\s*['"]?(https?:)?//""", text), "the page must not load anything"
    # The alert the fast rules fire for the straggler is on the timeline, for rank 1.
    straggler = [a for a in facts["alerts"] if a["alertname"] == "RankscopeStraggler"]
    assert straggler and all(a["rank"] == str(SLOW_RANK) for a in straggler), facts["alerts"]
    ops = {c["op"] for c in facts["collectives"]}
    assert "all_reduce" in ops


def chromium_screenshot(page: Path, shot: Path, width: int, height: int) -> list[str]:
    """Render ``page`` with headless Chromium into ``shot``; the page's own errors (console messages,
    uncaught exceptions, failed network requests) from its log. Name resolution is off: nothing
    outside the file can load."""
    proc = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--host-resolver-rules=MAP * ~NOTFOUND", "--enable-logging=stderr", "--v=0",
                           f"--window-size={width},{height}", f"--screenshot={shot}", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and shot.exists(), log[-3000:]
    return [line for line in log.splitlines() if re.search(r"CONSOLE|Uncaught|net::ERR_", line)]


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (tests/run.sh installs it when root)")
def test_headless_chromium_renders_the_page(report, tmp_path):
    facts, html, png_dir, _, _ = report
    # The page's height: its plots plus the text and tables around them.
    height = 1400 + sum(png_size((png_dir / f"{name}.png").read_bytes())[1] for name in PLOTS)
    shot = tmp_path / "report.png"
    page_errors = chromium_screenshot(html, shot, 1100, height)
    assert not page_errors, page_errors
    # The error check is real: a page with a script error is caught the same way.
    broken = tmp_path / "broken.html"
    broken.write_text("<html><body><p>x</p><script>no_such_function()</script></body></html>")
    assert any("no_such_function" in line for line in chromium_screenshot(broken, tmp_path / "broken.png", 400, 300))
    data = shot.read_bytes()
    assert png_size(data) == (1100, height)
    # The plots were drawn: a real share of the screenshot is saturated colour (text alone is grey).
    from PIL import Image

    image = Image.open(shot).convert("HSV")
    saturation = image.getchannel("S").histogram()
    coloured = sum(saturation[80:]) / (image.width * image.height)
    print(f"chromium screenshot {image.width}x{image.height}, {100 * coloured:.1f}% coloured pixels")
    assert coloured > 0.02
    if os.environ.get("RANKSCOPE_UPDATE_DOCS_IMAGES") == "1":   # refresh the README's picture, cut to the page
        from PIL import ImageOps

        page = Image.open(shot).convert("RGB")
        content = ImageOps.invert(page).getbbox()
        DOCS_IMAGE.parent.mkdir(parents=True, exist_ok=True)
        page.crop((0, 0, page.width, min(page.height, content[3] + 30))).save(DOCS_IMAGE, optimize=True)


def test_unknown_run_and_bad_url_are_one_line_errors(report, tmp_path):
    _, _, _, prom, job = report
    closed = free_port()
    for args, expected in (
        (["--prometheus", prom.url, "--run", "no-such-run"], ("no-such-run", "not found", job.run_id)),
        (["--prometheus", f"http://127.0.0.1:{closed}", "--run", job.run_id], ("cannot connect",)),
        (["--prometheus", job.url.rsplit("/", 1)[0], "--run", job.run_id], ("not a Prometheus server",)),
        (["--prometheus", prom.url, "--run", job.run_id, "--from", "yesterday"], ("bad time",)),
    ):
        proc = subprocess.run([*rankscope_command(), "report", *args, "--out", str(tmp_path / "r.html")],
                              capture_output=True, text=True, timeout=60, env=_env())
        assert proc.returncode == 2, (args, proc.returncode, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stderr + proc.stdout
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("rankscope: error: "), proc.stderr
        for text in expected:
            assert text in lines[0], (text, lines[0])
    assert not (tmp_path / "r.html").exists()
