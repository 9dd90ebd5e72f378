"""The replica check's parts (rankscope.replicas): the fingerprint, its published value, the check's
steps and drops, and its CUDA path against the strict double. Real multi-rank jobs compare replicas
in tests/drills/test_replica_drills.py; tests/integration/test_same_weights.py shows the check
changes no weight."""

from __future__ import annotations

import pytest
import torch

from rankscope.device.rank_device import RankDevice
from rankscope.errors import TelemetryErrors
from rankscope.publishing.metrics import RankMetrics
from rankscope.contract.replicas import FINGERPRINT_BITS, encode, step_of
from rankscope.replicas.check import ReplicaCheck, parts, tensor_sums
from rankscope.replicas.sets import ReplicaSet, find
from tests.helpers.strict_cuda import StrictCuda, in_thread

IDENTITY = {"run": "replicas", "rank": "0", "local_rank": "0", "node": "n"}


def test_the_fingerprint_is_the_same_in_any_order_and_moves_with_one_bit():
    """A float sum's last bits depend on the order of its additions; an integer sum of the bits
    does not: the halves' sums, added in either order, give the whole's (wrapping in int64), on the
    64-bit-word path (contiguous) and the per-element one (a strided view). One flipped bit anywhere
    (a low mantissa bit, the exponent, the sign) moves it."""
    torch.manual_seed(0)
    t = torch.randn(10_000)
    halves = tensor_sums([t[5_000:], t[:5_000]]).tolist()
    assert tensor_sums([t]).item() == _wrap(sum(halves))
    strided = t[::2]
    assert tensor_sums([strided]).item() == _wrap(sum(tensor_sums([strided[2_500:], strided[:2_500]]).tolist()))
    for view in (t, strided):
        for bit in (0, 12, 23, 30, 31):
            flipped = view.clone()
            flipped.view(torch.int32)[1234] ^= 1 << bit
            assert encode(7, tensor_sums([flipped]).item()) != encode(7, tensor_sums([view]).item()), bit
    half = torch.randn(63, dtype=torch.bfloat16)   # 126 bytes: not whole words, the per-element path
    assert tensor_sums([half, t]).dtype == torch.int64 and len(tensor_sums([half, t])) == 2


def _wrap(n: int) -> int:
    return (n + 2**63) % 2**64 - 2**63


def test_the_published_value_holds_the_step_and_stays_exact_in_a_float():
    for step, total in ((0, 0), (200, -1), (12_400, 2**63 - 1), (2**27 + 5, 123)):
        value = encode(step, total)
        assert value == int(value) and value < 2**53
        assert step_of(value) == step % 2**27
        assert int(value) & (2**FINGERPRINT_BITS - 1) == int(encode(0, total))
    assert encode(200, 5) != encode(300, 5)   # the same bits at two steps are two checks


def test_the_rules_read_the_value_as_the_rank_writes_it():
    from prometheus.rules_spec import REPLICA_STEP_UNIT
    from rankscope.contract.replicas import STEP_UNIT

    assert int(REPLICA_STEP_UNIT) == STEP_UNIT


def test_parts_cover_every_tensor_once_in_order():
    assert parts(3) == [(0, 1), (1, 2), (2, 3)]
    covered = [i for start, stop in parts(100) for i in range(start, stop)]
    assert covered == list(range(100)) and len(parts(100)) == 8


def test_a_model_without_replicas_has_no_check():
    """A plain module (not DDP, no DTensor): nothing to compare, nothing to pay."""
    assert find(torch.nn.Linear(4, 2)) == []


def _check(tmp_path, params, every=10, device=None, drops=None):
    metrics = RankMetrics(tmp_path, IDENTITY)
    model = torch.nn.Module()
    for i, p in enumerate(params):
        model.register_parameter(f"w{i}", p)
    replica_set = ReplicaSet("ddp", "0", "", 2, tuple(f"w{i}" for i in range(len(params))), tuple(params))
    check = ReplicaCheck(model, [replica_set], every, metrics, device or RankDevice(lambda *a: None),
                         lambda what, reason: (drops if drops is not None else []).append((what, reason)))
    return check, metrics, model


def _published(metrics) -> dict[tuple[str, str, str], float]:
    family = metrics.family("rankscope_replica_fingerprint")
    return {(s.labels["of"], s.labels["part"], s.labels["slot"]): s.value
            for m in family.collect() for s in m.samples}


def test_a_check_step_publishes_its_weights_and_gradients_once(tmp_path):
    params = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]
    check, metrics, _ = _check(tmp_path, params)
    check.step_ended(5)                  # not a check step
    check.before_optimizer_step(-1)      # outside a step
    check.publish()
    assert _published(metrics) == {}
    for p in params:
        p.grad = torch.ones_like(p)
    check.before_optimizer_step(10)
    params[0].grad = None                # a second optimizer's step in the same step: not taken again
    check.before_optimizer_step(10)
    check.step_ended(10)
    check.publish()
    published = _published(metrics)
    expected = tensor_sums([p.detach() for p in params]).tolist()
    assert published[("weights", "all", "1")] == encode(10, sum(expected))
    assert published[("weights", "0", "1")] == encode(10, expected[0])
    assert published[("grads", "all", "1")] == encode(10, sum(tensor_sums([torch.ones(8, 4), torch.ones(4)]).tolist()))
    check.step_ended(20)
    check.publish()
    assert step_of(_published(metrics)[("weights", "all", "0")]) == 20   # the other slot: both checks kept
    assert step_of(_published(metrics)[("weights", "all", "1")]) == 10


def test_parameters_reshaped_after_watch_skip_the_check_counted_never_a_wrong_value(tmp_path):
    drops: list[tuple[str, str]] = []
    params = [torch.nn.Parameter(torch.randn(8, 4))]
    check, metrics, model = _check(tmp_path, params, drops=drops)
    model.w0 = torch.nn.Parameter(torch.randn(16, 4))   # a new head, say
    check.step_ended(10)
    check.publish()
    assert _published(metrics) == {}
    assert [what for what, _ in drops] == ["replica_check"] and "reshaped" in drops[0][1]
    model.register_parameter("added", torch.nn.Parameter(torch.randn(3)))   # a parameter added mid-run
    check.step_ended(20)
    check.publish()
    assert _published(metrics) == {} and len(drops) == 2


def test_on_cuda_the_fingerprint_is_read_later_never_waited_for(tmp_path):
    """The sums stay on the device; a pinned copy behind an event, read by the publisher thread."""
    with StrictCuda(rank_device=1) as cuda:
        cuda.set_device(1)
        device = RankDevice(lambda *a: None)
        device.bind("cuda:1")
        params = [torch.nn.Parameter(torch.randn(8, 4))]
        check, metrics, _ = _check(tmp_path, params, device=device)
        check.step_ended(10)
        assert _published(metrics) == {}

        def publish():
            with device.on_device():
                device.reads.deliver_arrays()
            check.publish()

        in_thread(publish, "rankscope-publisher")
        assert _published(metrics)[("weights", "all", "1")] == encode(10, tensor_sums(params).sum().item())


def test_a_negative_check_interval_is_refused_at_start_up():
    from rankscope.config import ConfigError, MonitorConfig

    with pytest.raises(ConfigError, match="replica_check_every"):
        MonitorConfig(replica_check_every=-1)


def _fingerprints(run: str, values: dict[int, list[tuple[int, int]]], size: int) -> list:
    """Exporter samples: rank -> [(step, fingerprint), ...] (one per slot), and each rank's group size."""
    from rankscope.console.sources import Series

    out = []
    for rank, checks in values.items():
        base = {"run": run, "rank": str(rank), "replicas": "ddp", "group": "0", "shard": ""}
        out.append(Series("rankscope_replica_group_size", base, size))
        for slot, (step, fp) in enumerate(checks):
            out.append(Series("rankscope_replica_fingerprint",
                              {**base, "of": "weights", "part": "all", "slot": str(slot)}, encode(step, fp)))
    return out


def test_the_console_judges_replicas_as_the_rules_do():
    """`rankscope top` and the report: the odd rank named once a majority holds another fingerprint;
    a check half the group has made is not judged (the older one is); two replicas split: both, a tie."""
    from rankscope.console.replicas import replica_groups

    odd = _fingerprints("r", {0: [(20, 5), (10, 1)], 1: [(20, 5), (10, 1)], 2: [(20, 6), (10, 1)],
                              3: [(20, 5), (10, 1)]}, 4)
    (group,) = replica_groups(odd, "r")
    assert (group.step, group.differing, group.agreeing, group.tie) == (20, [2], 3, False)
    assert group.line() == "ddp group 0: rank 2 differs at step 20 (3/4 agree)"
    early = _fingerprints("r", {0: [(10, 1)], 1: [(10, 1)], 2: [(20, 6), (10, 1)], 3: [(20, 5), (10, 1)]}, 4)
    assert replica_groups(early, "r")[0].line() == "ddp group 0: 4/4 agree at step 10"
    split = _fingerprints("r", {0: [(20, 5)], 1: [(20, 6)]}, 2)
    (group,) = replica_groups(split, "r")
    assert group.tie and group.differing == [0, 1] and "no majority" in group.line()
