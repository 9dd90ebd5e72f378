"""rankscope never changes what a job trains to (tests/loops/same_weights.py).

A real 4-rank gloo job trains two copies of a model side by side, one as the
user's code alone would and one under ``monitor.watch()``, with the comm hook
(``comm_timing=hook``: on CUDA the default). After every step their gradients,
and after the last their weights, must be equal bit for bit, wherever DDP's
group is not the world (``process_group=``, a group of three whose 1/3 is not
exact in binary, one dim of a 2-D device mesh), with and without
``gradient_as_bucket_view``, with the user's own comm hook (bf16, torch's fp16)
registered before or after ``watch()``, for FSDP1, FSDP2, HSDP and tensor-parallel models, with the
replica check (rankscope.replicas) fingerprinting every step.
"""

from __future__ import annotations

import pytest

from tests.helpers.userjob import UserJob

# scenario -> the timing strategy rankscope must end up with
EXPECTED = {
    "subgroup": "hook",       # DDP(process_group=) over {0,1} and {2,3}
    "odd_group": "hook",      # DDP over {0,1,2}: the bucket scaled exactly as DDP scales it
    "mesh_dim": "hook",       # DDP(device_mesh=mesh["dp"])
    "world": "hook",
    "hook_before": "reducer", # DDP takes one hook: the user's stays, DDP's own timers time it
    "hook_after": "hook",     # the user's hook runs inside rankscope's, timed
    "fp16_after": "hook",     # torch's fp16_compress_hook, registered after watch()
    "view_pair": "hook",      # gradient_as_bucket_view=True: DDP divides the bucket in place from step 2
    "view_odd": "hook",       # ... over a group of three, where dividing and multiplying by 1/3 differ
    "fsdp1": "off",           # not a DDP: read through the flight recorder, never hooked
    "fsdp2": "off",
    "hsdp": "off",
    "tp": "off",
}
# scenario -> the replica sets the check compares (every step: RANKSCOPE_REPLICA_CHECK_EVERY=1)
REPLICAS = {"world": ["ddp"], "subgroup": ["ddp"], "mesh_dim": ["ddp"], "fsdp1": [], "fsdp2": [],
            "hsdp": ["dp_replicate"], "tp": ["tp"]}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("same-weights")
    with UserJob("same_weights.py", *EXPECTED, "--steps", "5", nproc=4, tmp_path=tmp,
                 env={"RANKSCOPE_EXPORTER": "off", "RANKSCOPE_COMM_TIMING": "hook",
                      "RANKSCOPE_REPLICA_CHECK_EVERY": "1"}) as job:
        job.run(timeout=240)
        return {scenario: job.results(scenario) for scenario in EXPECTED}


@pytest.mark.parametrize("scenario", list(EXPECTED))
def test_a_watched_job_trains_to_the_same_weights_bit_for_bit(results, scenario):
    by_rank = results[scenario]
    assert sorted(by_rank) == [0, 1, 2, 3], by_rank
    for rank, r in by_rank.items():
        assert r["equal_grads"] and r["equal_weights"] and r["max_diff"] == 0.0, (rank, r)
        assert r["strategy"] == EXPECTED[scenario], (rank, r)


@pytest.mark.parametrize("scenario", list(REPLICAS))
def test_the_replica_check_ran_on_every_step_of_what_the_layout_replicates(results, scenario):
    for rank, r in results[scenario].items():
        assert [s["replicas"] for s in r["replica_sets"]] == REPLICAS[scenario], (rank, r)
        # published: the weights after each step (the loop steps its optimizers outside monitor.step())
        assert r["replica_fingerprints"] == (["weights"] if REPLICAS[scenario] else []), (rank, r)


@pytest.mark.parametrize("scenario", ["subgroup", "odd_group", "mesh_dim", "hook_after", "fp16_after", "view_pair",
                                      "view_odd"])
def test_the_hook_times_every_bucket_of_every_step(results, scenario):
    """Timed, not just harmless: at least one all-reduce per step and rank (more once
    DDP has rebuilt its buckets), the user's own hook included."""
    for rank, r in results[scenario].items():
        assert r["timed_all_reduces"] >= r["steps"], (rank, r)
