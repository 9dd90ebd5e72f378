"""Configuration and identity (rankscope.config, rankscope.identity): options from the environment
and their errors, the identity from torchrun, Slurm or defaults, and a second live job on a run
id in use."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from rankscope.config import ConfigError, MonitorConfig
from rankscope.contract.rundir import Registration, process_start_ticks, run_slug
from rankscope.identity import RankIdentity


def test_config_from_env_and_overrides(tmp_path):
    env = {"RANKSCOPE_METRICS_PORT": "9500", "RANKSCOPE_SPIKE_ZSCORE": "4.5", "RANKSCOPE_METRICS_DIR": str(tmp_path)}
    cfg = MonitorConfig.from_env(env, metrics_port=9600)
    assert cfg.metrics_port == 9600 and cfg.spike_zscore == 4.5 and cfg.metrics_dir == tmp_path


@pytest.mark.parametrize("env, option", [
    ({"RANKSCOPE_METRICS_PORT": "abc"}, "RANKSCOPE_METRICS_PORT"),
    ({"RANKSCOPE_METRICS_PORT": "70000"}, "metrics_port"),
    ({"RANKSCOPE_EXPORTER": "sometimes"}, "exporter"),
    ({"RANKSCOPE_COMM_TIMING": "magic"}, "comm_timing"),
    ({"RANKSCOPE_PUBLISH_INTERVAL_S": "0"}, "publish_interval_s"),
    ({"RANKSCOPE_LOSS_WINDOW": "1"}, "loss_window"),
])
def test_bad_config_names_the_option(env, option):
    with pytest.raises(ConfigError, match=option):
        MonitorConfig.from_env(env)


def test_unknown_option_and_file_as_directory(tmp_path):
    with pytest.raises(ConfigError, match="unknown option"):
        MonitorConfig.from_env({}, metrics_prot=1)
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(ConfigError, match="metrics_dir"):
        MonitorConfig.from_env({"RANKSCOPE_METRICS_DIR": str(f)})


def test_identity_from_torchrun_slurm_and_defaults():
    ident = RankIdentity.from_env(env={"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                                       "TORCHELASTIC_RUN_ID": "abc", "RANKSCOPE_NODE": "n7"})
    assert ident.labels == {"run": "abc", "rank": "3", "local_rank": "1", "node": "n7"}
    slurm = RankIdentity.from_env(env={"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                                       "SLURM_NTASKS_PER_NODE": "8", "SLURM_JOB_ID": "4242",
                                       "SLURMD_NODENAME": "gpu17"})
    assert (slurm.run, slurm.rank, slurm.node, slurm.slurm_job_id) == ("4242", 5, "gpu17", "4242")
    assert RankIdentity.from_env(env={}).run == "default"
    # torchrun --master-addr/--master-port (static rendezvous: its run id is "none"): the endpoint
    static = {"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "10.0.0.7",
              "MASTER_PORT": "29511"}
    assert RankIdentity.from_env(env=static).run == "10.0.0.7:29511"
    assert RankIdentity.from_env(env=static | {"SLURM_JOB_ID": "4242"}).run == "4242"        # the scheduler's id
    assert RankIdentity.from_env(env=static | {"JOB_NAME": "llama-pretrain"}).run == "llama-pretrain"
    assert RankIdentity.from_env(env=static | {"TORCHELASTIC_RUN_ID": "rdzv-9"}).run == "rdzv-9"
    assert RankIdentity.from_env(env=static | {"RANKSCOPE_RUN": "mine"}).run == "mine"
    with pytest.raises(ConfigError, match="RANK"):
        RankIdentity.from_env(env={"RANK": "x"})
    with pytest.raises(ConfigError, match="outside WORLD_SIZE"):
        RankIdentity.from_env(env={"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(ConfigError, match="RANK=3 is set but WORLD_SIZE is not"):   # a half-set launcher environment
        RankIdentity.from_env(env={"RANK": "3", "LOCAL_RANK": "3"})
    assert RankIdentity.from_env(env={"RANK": "0"}).world_size == 1                    # rank 0 alone: a 1-rank job


def test_a_second_live_job_on_a_run_id_in_use_is_caught(tmp_path, caplog):
    """Two jobs that land on one run id on one node would add their counts up: a live process
    registered as this rank, launched by another launcher, is another job, caught at start-up.
    A single-process job takes a run id of its own; a distributed one is refused, naming the
    other job. Another rank of the same run is not another job, whatever launched it (srun,
    mp.spawn and Lightning start each rank as its own process)."""
    from rankscope.contract.rundir import Registration, process_start_ticks, run_slug
    from rankscope.publishing.startup import claim_run

    other = subprocess.Popen(["sleep", "60"])
    try:
        ticks = process_start_ticks(other.pid)
        run_dir = tmp_path / run_slug("shared")
        Registration(run="shared", rank=0, local_rank=0, node="n1", world_size=2, local_world_size=2,
                     pid=other.pid, pid_start_ticks=ticks, agent_pid=other.pid, agent_start_ticks=ticks,
                     started_at=time.time()).save(run_dir)
        alone = RankIdentity.from_env(env={"RANKSCOPE_RUN": "shared"})
        with caplog.at_level("WARNING", logger="rankscope"):
            own = claim_run(alone, tmp_path)
        assert own.run == f"shared-{os.getpid()}" and f"pid {other.pid}" in caplog.text
        distributed = RankIdentity.from_env(env={"RANKSCOPE_RUN": "shared", "RANK": "0", "WORLD_SIZE": "2"})
        with pytest.raises(ConfigError, match=rf"run 'shared' on node .* still running \(its rank 0 is pid "
                                              rf"{other.pid}.*RANKSCOPE_RUN"):
            claim_run(distributed, tmp_path)
        peer = RankIdentity.from_env(env={"RANKSCOPE_RUN": "shared", "RANK": "1", "WORLD_SIZE": "2"})
        assert claim_run(peer, tmp_path).run == "shared"   # the same job's other rank
        assert claim_run(RankIdentity.from_env(env={"RANKSCOPE_RUN": "another"}), tmp_path).run == "another"
    finally:
        other.kill()
        other.wait()
    assert claim_run(distributed, tmp_path).run == "shared"   # its job is gone: a relaunch, not a clash
