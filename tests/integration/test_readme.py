"""The README opens with two commands; the first (the demo) really runs a
2-rank job with live /metrics, next to Prometheus and Alertmanager."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
import urllib.request

from tests.helpers.jobs import REPO, free_port, scrape, value, wait_until


def test_readme_opens_with_the_two_commands_and_ci_runs_the_second():
    readme = (REPO / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["bash deploy/local/demo.sh", "bash tests/run.sh"]
    assert readme.index("```bash") < 200
    assert "bash tests/run.sh" in (REPO / ".ci/run").read_text()


def test_demo_runs_a_two_rank_job_with_live_metrics_and_prometheus():
    port, prom, am = free_port(), free_port(), free_port()
    metrics_dir = tempfile.mkdtemp(prefix="rankscope-demo-test-")
    env = {**os.environ, "PORT": str(port), "PROM_PORT": str(prom), "AM_PORT": str(am), "STEPS": "400",
           "RANKSCOPE_METRICS_DIR": metrics_dir}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    proc = subprocess.Popen(["bash", "deploy/local/demo.sh", "--step-delay", "0.02"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    exporter_pid = None
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        wait_until(lambda: all((value(scrape(url), "rankscope_steps_total", rank=r) or 0) > 0 for r in "01"),
                   timeout=240, what="live /metrics of both ranks")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            exporter_pid = json.loads(r.read())["pid"]

        def prometheus_scraped():
            q = urllib.request.quote('rankscope_steps_total{rank="1"}')
            with urllib.request.urlopen(f"http://127.0.0.1:{prom}/api/v1/query?query={q}", timeout=5) as r:
                return json.loads(r.read())["data"]["result"]

        wait_until(prometheus_scraped, timeout=60, what="Prometheus to scrape the demo's exporter")
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:]
        assert "step 400/400" in out and f"http://127.0.0.1:{port}/metrics" in out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if exporter_pid:
            os.kill(exporter_pid, signal.SIGKILL)
        subprocess.run(["rm", "-rf", metrics_dir])
