"""The observed values' one declaration (rankscope.step.observed) and what follows it: the keyword
of ``Step.observe``, the gauge in the contract, and the path from a step to the page, for every
declared value, in the declared order."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from rankscope.contract import catalog
from rankscope.publishing.metrics import RankMetrics
from rankscope.publishing.publisher import write_step_values
from rankscope.step.observed import NAMES, OBSERVED_VALUES
from rankscope.step.records import Overflow
from rankscope.step.timer import Step
from tests.unit.step.test_step_path import run_step, step_path


def test_observe_takes_the_declared_values_as_keywords_in_their_order():
    # Step.observe fills its slots by position: a keyword out of the declared order would put a
    # value in another's slot.
    keywords = [p.name for p in inspect.signature(Step.observe).parameters.values()][1:]
    assert keywords == list(NAMES)


@pytest.mark.parametrize("value", OBSERVED_VALUES, ids=NAMES)
def test_each_declared_value_has_its_gauge_in_the_contract(value):
    spec = catalog.BY_NAME.get(value.metric)
    assert spec is not None and spec.kind == "gauge" and spec.labels == (), value


def _page(tmp_path, acc) -> dict[str, float]:
    (tmp_path / "m").mkdir()
    metrics = RankMetrics(tmp_path / "m", {"rank": "0", "local_rank": "0", "node": "n", "run": "r"})
    write_step_values(metrics, acc)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, str(tmp_path / "m"))
    return {s.name: s.value for family in registry.collect() for s in family.samples}


def test_every_declared_value_travels_from_observe_to_its_gauge(tmp_path):
    timer, handoff, accounting, errors = step_path(tmp_path)
    sent = {name: 0.5 + i for i, name in enumerate(NAMES)}
    run_step(timer, **{name: torch.tensor(v) for name, v in sent.items()})   # tensors: read off the thread
    acc = accounting.take(handoff.entries, (), Overflow(), 0)
    page = _page(tmp_path, acc)
    assert {v.name: page[v.metric] for v in OBSERVED_VALUES} == sent
    assert errors.seen == []


def test_a_versioned_value_changed_after_its_step_is_dropped_and_the_others_are_not(tmp_path):
    timer, handoff, accounting, errors = step_path(tmp_path)
    sent = {name: torch.tensor(1.0 + i) for i, name in enumerate(NAMES)}
    run_step(timer, **sent)
    for tensor in sent.values():
        tensor.add_(100.0)   # in place, before the publisher reads it
    acc = accounting.take(handoff.entries, (), Overflow(), 0)
    kept = {v.name for v in OBSERVED_VALUES if not v.versioned}
    assert set(acc.observed) == kept
    assert all(math.isclose(acc.observed[name], float(sent[name])) for name in kept)   # read as it is now
    assert [what for what, _ in errors.seen] == ["value_modified"] * (len(NAMES) - len(kept))
