"""The deployment files driving real processes (tests/unit/test_deploy.py checks them offline)."""

from __future__ import annotations
import json
import os
import sys
import urllib.request
from pathlib import Path
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from tests.helpers.otlp_receiver import OtlpReceiver
from tests.helpers.promstack import PrometheusServer, free_port, poll

from tests.unit.test_deploy import (SLURM, _run_job, _start_exporter, _stop, _with_option, compose, rules_job, run)  # noqa: F401 - fixtures too


@pytest.mark.integration  # a torchrun job and an exporter process
def test_compose_wiring_runs_a_real_job(compose, tmp_path):
    """The exporter and trainer services' commands and environment, run here
    as processes (service addresses mapped to loopback, the volume to a temp
    dir): the ranks find the separate exporter, it serves both ranks with the
    compose run/node labels, and spans reach an OTLP receiver."""
    exporter_svc, trainer_svc = compose["services"]["exporter"], compose["services"]["trainer"]
    port, metrics_dir = free_port(), tmp_path / "metrics"
    exporter_cmd = _with_option(_with_option(_with_option(
        exporter_svc["command"], "--addr", "127.0.0.1"), "--port", str(port)), "--dir", str(metrics_dir))
    assert exporter_cmd[0] == "python"
    trainer_cmd = _with_option(_with_option(_with_option(
        trainer_svc["command"], "--steps", "20"), "--step-delay", "0"), "--metrics-port", str(port))
    assert trainer_cmd[0] == "torchrun"

    with OtlpReceiver() as receiver:
        env = {**os.environ, **trainer_svc["environment"], "RANKSCOPE_METRICS_DIR": str(metrics_dir),
               "RANKSCOPE_METRICS_ADDR": "127.0.0.1", "RANKSCOPE_METRICS_PORT": str(port),
               "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}
        exporter = _start_exporter(port, metrics_dir, command=[sys.executable, *exporter_cmd[1:]],
                                   env={**os.environ, **exporter_svc["environment"]})
        try:
            torchrun = str(Path(sys.executable).with_name("torchrun"))
            assert _run_job([torchrun, *trainer_cmd[1:]], env=env, timeout=150) == 0

            def both_ranks_finished() -> bool:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                        text = r.read().decode()
                except OSError:  # a slow scrape on a busy machine: try again
                    return False
                finished = {s.labels["rank"] for f in text_string_to_metric_families(text) for s in f.samples
                            if s.name == "rankscope_rank_state" and s.labels["state"] == "finished"
                            and s.value == 1 and s.labels["run"] == env["RANKSCOPE_RUN"]
                            and s.labels["node"] == env["RANKSCOPE_NODE"]}
                return finished == {"0", "1"}

            poll(both_ranks_finished, timeout=30, what="rank_state finished for ranks 0 and 1 of the compose run")
            spans = receiver.wait_for_spans(lambda spans: len(spans) > 0, timeout=30)
            assert any(s.resource.get("service.name") == env["OTEL_SERVICE_NAME"] for s in spans)
        finally:
            _stop(exporter)


@pytest.mark.integration  # an exporter process and Prometheus
def test_slurm_prolog_and_epilog_register_the_node_with_a_real_prometheus(tmp_path):
    sd_dir, state_dir = tmp_path / "file_sd", tmp_path / "state"
    port = free_port()
    env = {**os.environ, "RANKSCOPE_SD_DIR": str(sd_dir), "RANKSCOPE_STATE_DIR": str(state_dir),
           "RANKSCOPE_PORT": str(port), "RANKSCOPE_TARGET_HOST": "127.0.0.1",
           "RANKSCOPE_SHM_PREFIX": str(tmp_path / "shm-"), "SLURMD_NODENAME": "gpu-node-7",
           "SLURM_CLUSTER_NAME": "testcluster"}

    def slurm(script: str, job: str) -> None:
        result = run(["bash", str(SLURM / script)], env={**env, "SLURM_JOB_ID": job})
        assert result.returncode == 0 and not result.stderr, result.stderr

    config = yaml.safe_load((SLURM / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"}
    config.pop("rule_files"), config.pop("alerting")
    scrape = config["scrape_configs"][0]
    scrape["scrape_interval"] = "1s"
    scrape["file_sd_configs"][0]["files"] = [str(sd_dir / "*.json")]
    scrape["file_sd_configs"][0]["refresh_interval"] = "1s"

    (tmp_path / "shm-101").mkdir()
    exporter = _start_exporter(port, tmp_path / "metrics")
    try:
        slurm("prolog.sh", "101")
        slurm("prolog.sh", "102")           # a second job on the same node
        (sd_file,) = sd_dir.glob("*.json")
        assert sd_file.name == "gpu-node-7.json"
        assert json.loads(sd_file.read_text()) == [
            {"targets": [f"127.0.0.1:{port}"], "labels": {"slurm_cluster": "testcluster"}}]

        with PrometheusServer(config) as prom:
            (target,) = prom.wait_for_scrape(timeout=40)
            assert target["labels"]["job"] == rules_job()
            assert target["labels"]["slurm_cluster"] == "testcluster"
            assert prom.wait_for(lambda: prom.query(f'rankscope_exporter_info{{job="{rules_job()}"}}'), timeout=20)

            slurm("epilog.sh", "101")       # job 102 still runs: the node stays a target
            assert sd_file.exists() and not (tmp_path / "shm-101").exists()
            slurm("epilog.sh", "102")
            assert not sd_file.exists()
            prom.wait_for(lambda: not prom.targets(), timeout=30, what="target removed")
    finally:
        _stop(exporter)
