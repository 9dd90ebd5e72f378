"""The metric-name contract: every catalog entry follows the conventions, and
the README's catalog lists every metric (generated from the catalogs by
deploy/generate.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rankscope.exporter import catalog as exporter_catalog
from rankscope.contract import catalog

ALL = catalog.RANK_METRICS + exporter_catalog.EXPORTER_METRICS
BASE_UNITS = ("seconds", "bytes", "ratio", "celsius", "watts", "joules", "hertz", "total")
FORBIDDEN_LABELS = {"job", "instance", "step", "le", "quantile", "pid"}
REPO = Path(__file__).resolve().parents[3]


def check_spec(spec) -> list[str]:
    """Every convention a metric must follow; returns the violations."""
    problems = []
    name = spec.name
    if not re.fullmatch(r"rankscope_[a-z][a-z0-9_]*[a-z0-9]", name):
        problems.append("name must be rankscope_ + lower_snake_case")
    if spec.kind == "counter" and not name.endswith("_total"):
        problems.append("counters end in _total")
    if spec.kind != "counter" and name.endswith("_total"):
        problems.append("only counters end in _total")
    if re.search(r"_(ms|milliseconds|us|kb|mb|gb|mib|gib|percent)(_|$)", name):
        problems.append("use base units (seconds, bytes, ratio)")
    if name.endswith(("_sum", "_count", "_bucket", "_created")):
        problems.append("reserved suffix")
    if "timestamp" in name and not name.endswith("_timestamp_seconds"):
        problems.append("timestamps end in _timestamp_seconds")
    bad = FORBIDDEN_LABELS & set(spec.label_names)
    if bad:
        problems.append(f"forbidden labels {sorted(bad)}")
    if len(set(spec.label_names)) != len(spec.label_names):
        problems.append("duplicate labels")
    if not spec.help or not spec.help.endswith((".", ")")):
        problems.append("help must be a sentence")
    if spec.kind == "histogram" and (not spec.buckets or list(spec.buckets) != sorted(spec.buckets)):
        problems.append("histograms need sorted buckets")
    if spec.kind == "gauge" and spec.gauge_mode not in ("mostrecent", "livemostrecent"):
        problems.append("rank gauges are per-rank: mostrecent or livemostrecent")
    return problems


@pytest.mark.parametrize("spec", ALL, ids=lambda s: s.name)
def test_metric_follows_conventions(spec):
    assert check_spec(spec) == []


def test_the_checker_catches_violations():
    from rankscope.contract.catalog import MetricSpec

    assert check_spec(MetricSpec("rankscope_steps", "counter", "Steps."))
    assert check_spec(MetricSpec("rankscope_step_ms", "gauge", "Step."))
    assert check_spec(MetricSpec("rankscope_x_seconds", "gauge", "X.", ("job",)))
    assert check_spec(MetricSpec("rankscope_x_seconds", "gauge", "X.", ("step",)))
    assert check_spec(MetricSpec("torch_x_seconds", "gauge", "X."))


def test_names_are_unique_and_rank_series_carry_identity():
    names = [m.name for m in ALL]
    assert len(names) == len(set(names))
    for m in catalog.RANK_METRICS:
        assert m.label_names[:4] == catalog.IDENTITY_LABELS


def test_readme_catalog_lists_every_metric():
    # That it is exactly the generated table is checked with every generated
    # file by tests/unit/test_deploy.py (deploy/generate.py --check).
    readme = (REPO / "README.md").read_text()
    assert readme.count(exporter_catalog.START) == 1 and readme.count(exporter_catalog.END) == 1
    catalog_text = readme.split(exporter_catalog.START)[1].split(exporter_catalog.END)[0]
    for m in ALL:
        assert f"`{m.name}`" in catalog_text
