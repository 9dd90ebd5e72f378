"""The replica check changes nothing a framework trains: a real transformers.Trainer job and a
real Lightning job (tests/loops/hf_trainer.py, lightning_trainer.py; 2 ranks, DDP on gloo) train
to the same weights, bit for bit on every rank, with the check fingerprinting every step
(RANKSCOPE_REPLICA_CHECK_EVERY=1: weights after each optimizer step, gradients before it) and
with it off (0). The torchtitan adapter's job compares itself with a run without rankscope
(tests/integration/test_integrations_torchtitan.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers.userjob import UserJob

HF_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
LOOPS = {"hf": ("hf_trainer.py", "--steps", "8", "--save-every", "100"),
         "lightning": ("lightning_trainer.py", "--steps", "8")}


def _weights(loop: str, every: str, tmp) -> dict:
    script, *args = LOOPS[loop]
    env = {**HF_ENV, "RANKSCOPE_REPLICA_CHECK_EVERY": every, "RANKSCOPE_EXPORTER": "off"}
    with UserJob(script, *args, nproc=2, tmp_path=tmp, env=env, name=f"{loop}-check-{every}") as job:
        job.run(timeout=240)
        return {rank: (r["weights_sha256"], r["replica_checked"]) for rank, r in job.results().items()}


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> dict:
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {(loop, every): pool.submit(_weights, loop, every, tmp_path_factory.mktemp(f"{loop}-{every}"))
                   for loop in LOOPS for every in ("1", "0")}
        return {key: f.result() for key, f in futures.items()}


@pytest.mark.parametrize("loop", list(LOOPS))
def test_the_replica_check_changes_no_weight(loop, weights):
    on, off = weights[(loop, "1")], weights[(loop, "0")]
    assert sorted(on) == sorted(off) == [0, 1], (on, off)
    for rank in on:
        assert on[rank][0] == off[rank][0], (loop, rank)
        assert on[rank][1] and not off[rank][1], (loop, rank, on[rank], off[rank])   # on: checked; off: not
    assert on[0][0] == on[1][0]   # and the replicas agree with each other
