"""Where a rank sits in its job's parallel layout (rankscope.layout): stated in one line, or
learnt from a device mesh or a pipeline stage given to watch(), and exported once per rank as
rankscope_rank_layout_info, which the rules join to compare like with like."""

from __future__ import annotations

import pytest
import torch

from rankscope import ConfigError, Monitor
from rankscope.config import MonitorConfig
from rankscope.layout import Layout, group_roles, learn
from tests.unit.test_monitor_api import LAUNCH_VARS, published


@pytest.fixture
def clean_env(monkeypatch):
    for var in (*LAUNCH_VARS, "RANKSCOPE_LAYOUT"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def layout_series(m: Monitor) -> dict[tuple, float]:
    return {k[1:]: v for k, v in published(m).items() if k[0] == "rankscope_rank_layout_info"}


def test_stage_and_tensor_parallel_group_from_coordinates():
    layout = Layout.parse("pp=1, dp_shard=3, tp=2")
    assert layout.labels() == {"stage": "1", "tp_group": "pp=1,dp_shard=3", "mesh": "pp=1,dp_shard=3,tp=2"}
    # The ranks of one tensor-parallel group share its name; another group's differs.
    assert Layout.parse("pp=1,dp_shard=3,tp=0").tp_group == layout.tp_group
    assert Layout.parse("pp=1,dp_shard=2,tp=2").tp_group != layout.tp_group
    assert Layout.parse("dp=4").labels() == {"stage": "", "tp_group": "", "mesh": "dp=4"}
    assert Layout.parse("tp=1").tp_group == "all"
    assert Layout.parse(None) == Layout.parse("") == Layout()
    assert Layout.of({"pipeline": 2, "dp": 0}).stage == "2"


@pytest.mark.parametrize("text, match", [
    ("pp", "name=coordinate"), ("pp=-1", "name=coordinate"), ("pp=one", "name=coordinate"),
    ("pp=1,pp=2", "named twice"), ("pp=1,stage=2", "one pipeline"), ("p-p=1", "dimension name"),
    (",".join(f"d{i}=0" for i in range(9)), "at most 8"),
])
def test_a_wrong_layout_is_a_start_up_error_naming_the_option(clean_env, text, match):
    with pytest.raises(ConfigError, match=match):
        MonitorConfig(layout=text)
    clean_env.setenv("RANKSCOPE_LAYOUT", text)
    with pytest.raises(ConfigError, match="RANKSCOPE_LAYOUT"):
        MonitorConfig.from_env()
    with pytest.raises(ConfigError, match="layout"):
        Layout.of(object())


def test_a_stated_layout_wins_and_a_learnt_one_adds_what_it_leaves_out():
    stated = Layout.parse("pp=1")
    assert stated.merged(Layout.parse("pp=0,dp=1,tp=0")).mesh == "pp=1,dp=1,tp=0"
    assert stated.merged(Layout.parse("pipeline=0,tp=1")).mesh == "pp=1,tp=1"   # one pipeline dimension
    assert Layout.parse("tp=0").merged(Layout.parse("tensor=1,dp=2")).mesh == "tp=0,dp=2"   # one tensor dimension
    assert stated.merged(stated) is stated


def test_the_monitor_exports_its_layout_once_and_replaces_it_when_watch_learns_more(tmp_path, clean_env):
    clean_env.setenv("RANKSCOPE_LAYOUT", "pp=1")
    m = Monitor(exporter="off", metrics_dir=tmp_path, run="layout", publish_interval_s=60)
    try:
        assert layout_series(m) == {("pp=1", "1", ""): 1.0}   # (mesh, stage, tp_group)
        m._learn_layout(Layout.parse("dp=0,tp=1"))
        assert layout_series(m) == {("pp=1", "1", ""): 0.0, ("pp=1,dp=0,tp=1", "1", "pp=1,dp=0"): 1.0}
    finally:
        m.close()
    clean_env.delenv("RANKSCOPE_LAYOUT")
    m = Monitor(exporter="off", metrics_dir=tmp_path / "b", run="plain", publish_interval_s=60)
    try:
        assert layout_series(m) == {("", "", ""): 1.0}   # a job without a layout: one stage
    finally:
        m.close()


def test_watch_learns_the_mesh_of_a_sharded_model_and_the_stage_of_a_pipeline_stage(tmp_path, clean_env):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.tensor import Replicate, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    m = Monitor(exporter="off", metrics_dir=tmp_path / "m", run="mesh", publish_interval_s=60)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        model = torch.nn.Linear(4, 4)
        model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), mesh["tp"], [Replicate()]))
        assert learn(model) == Layout.parse("dp=0,tp=0")   # the root of the parameter's sub-mesh
        assert m.watch(model) is model
        assert layout_series(m)[("dp=0,tp=0", "", "dp=0")] == 1.0
        assert learn(torch.nn.Linear(2, 2)) is None          # plain parameters: nothing to learn
        stage = PipelineStage(torch.nn.Linear(4, 4), stage_index=0, num_stages=1, device=torch.device("cpu"))
        assert m.watch(stage) is stage
        assert layout_series(m)[("dp=0,tp=0,pp=0", "0", "dp=0,pp=0")] == 1.0
        # FSDP over the whole world reuses the default group: it is named by its mesh dimension.
        whole = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
        sharded = torch.nn.Linear(4, 4)
        sharded.weight = torch.nn.Parameter(distribute_tensor(sharded.weight.detach(), whole, [Replicate()]))
        assert group_roles(sharded) == {dist.group.WORLD.group_name: "dp_shard"}
        assert group_roles(torch.nn.Linear(2, 2)) == {}
        m.watch(sharded)
        assert m.parts.process_groups.roles[dist.group.WORLD.group_name] == "dp_shard"
        with pytest.raises(ConfigError, match="PipelineStage"):
            m.watch(object())
    finally:
        m.close()
        dist.destroy_process_group()


def test_each_step_publishes_its_own_compute(clean_env, tmp_path):
    """rankscope_step_last_compute_seconds: forward+backward+optimizer of the last step, its
    comm wait left out: what the load-imbalance rule compares across the ranks of a stage."""
    import time

    m = Monitor(exporter="off", metrics_dir=tmp_path, run="compute", publish_interval_s=60)
    try:
        for work in (0.01, 0.03):
            with m.step() as step:
                with step.phase("forward"):
                    time.sleep(work)
                with step.phase("comm_wait"):
                    time.sleep(0.02)
                with step.phase("optimizer"):
                    time.sleep(work)
        got = published(m)[("rankscope_step_last_compute_seconds",)]
        assert 0.06 <= got < 0.075

        # Where DDP's wait in backward is only sampled (its own timers, the CPU default), backward
        # holds this step's wait less an estimate from another step: it is left out.
        from rankscope.collectives.comm_timing import CommTiming

        class Sampled(CommTiming):
            waits_known_each_step = False

        m.parts.watched.use_comm_timing(Sampled())
        with m.step() as step:
            with step.phase("forward"):
                time.sleep(0.01)
            with step.phase("backward"):
                time.sleep(0.03)
        got = published(m)[("rankscope_step_last_compute_seconds",)]
        assert 0.01 <= got < 0.02
    finally:
        m.close()
