"""The scale simulator (tests/scale/simulator.py): its pages are the recorded exporter
page's series, in the documented budget, and carry the three injected faults."""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

from rankscope.contract import catalog as rank_catalog
from rankscope.exporter.catalog import BY_NAME as EXPORTER_METRICS
from tests.scale.simulator import RANKS_PER_NODE, Layout, NodePage, load_recorded

# The recorded CPU rank's series, plus what a GPU rank adds (device memory x3, peak FLOP/s) and
# the goodput, data-wait and model-FLOPs series added to the catalog after the recording.
SERIES_PER_RANK = 143
SERIES_PER_NODE = 1340
START = 1_000_000.0


def _family(name: str) -> str:
    return re.sub(r"_(bucket|sum|count)$", "", name)


def page_samples(layout: Layout, node: int, at: float) -> list:
    rank_samples, node_samples = load_recorded()
    text = NodePage(layout, node, rank_samples, node_samples).render(now=at).decode()
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def test_recorded_series_are_in_the_catalogs():
    """A stale recording would simulate series the exporter no longer serves."""
    rank_samples, node_samples = load_recorded()
    known = set(rank_catalog.BY_NAME) | set(EXPORTER_METRICS)
    # User metrics (the reference trainer's evaluation loss and accuracy) are the job's own.
    names = {_family(n) for n, _, _ in rank_samples + node_samples if not n.startswith(rank_catalog.USER_PREFIX)}
    assert names <= known, names - known


def test_series_budget_per_rank_and_node():
    rank_samples, _ = load_recorded()
    assert len(rank_samples) == SERIES_PER_RANK
    samples = page_samples(Layout(4, START, 100), 0, START + 50)
    assert len(samples) == SERIES_PER_NODE
    assert len({(s.name, tuple(sorted(s.labels.items()))) for s in samples}) == SERIES_PER_NODE  # no duplicates
    assert {s.labels["rank"] for s in samples if "rank" in s.labels} == {str(r) for r in range(RANKS_PER_NODE)}


def _value(samples, name, **labels) -> float:
    (found,) = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    return found


def test_the_faults_appear_on_their_ranks_only():
    layout = Layout(8, START, fault_after=100)
    faults = layout.faults()
    by_node = {}
    for node in range(8):
        by_node[node] = page_samples(layout, node, START + 200)  # the hang is 100 s old
    everything = [s for ss in by_node.values() for s in ss]
    nan = [s.labels["rank"] for s in everything if s.name == "rankscope_nonfinite_total" and s.value >= 1]
    assert nan == [str(faults["nan"]["rank"])]
    suspects = [(s.labels["run"], s.labels["rank"]) for s in everything
                if s.name == "rankscope_hang_suspect" and s.value == 1]
    assert suspects == [(faults["hang"]["run"], str(faults["hang"]["rank"]))]
    waiting = {s.labels["rank"] for s in everything if s.name == "rankscope_rank_state"
               and s.labels["state"] == "stuck_in_collective" and s.value == 1}
    hang_run_ranks = {s.labels["rank"] for s in everything
                      if s.name == "rankscope_rank_up" and s.labels["run"] == faults["hang"]["run"]}
    assert waiting == hang_run_ranks - {str(faults["hang"]["rank"])}

    def compute_per_step(rank: int) -> float:
        ss = [s for s in everything if s.labels.get("run") == faults["straggler"]["run"]
              and s.labels.get("rank") == str(rank)]
        compute = sum(_value(ss, "rankscope_phase_seconds_total", phase=p) for p in ("forward", "backward", "optimizer"))
        return compute / _value(ss, "rankscope_steps_total")

    straggler = faults["straggler"]["rank"]
    assert 1.4 < compute_per_step(straggler) / compute_per_step(straggler - 1) < 1.6


def test_before_the_fault_nothing_is_wrong_but_the_straggler():
    layout = Layout(8, START, fault_after=100)
    everything = [s for node in range(8) for s in page_samples(layout, node, START + 50)]
    assert not [s for s in everything if s.name in ("rankscope_hang_suspect", "rankscope_nonfinite_total") and s.value]
    assert {s.labels["state"] for s in everything if s.name == "rankscope_rank_state" and s.value == 1} == {"progressing"}
