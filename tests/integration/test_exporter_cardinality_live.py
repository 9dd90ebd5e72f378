"""--rank-histograms with real exporters, promtool and Prometheus (the unit tests: tests/unit/exporter/test_cardinality.py)."""

from __future__ import annotations
import subprocess
from collections import defaultdict
import pytest
import yaml
from rankscope.exporter import catalog as exporter_catalog
from rankscope.exporter.catalog import node_histogram_name
from rankscope.exporter.exposition import Renderer

from tests.unit.exporter.test_cardinality import (Frozen, HISTOGRAMS, LIVE_RANKS, OPENMETRICS, TIME_DERIVED, collect, family_of, live_node, metrics_dir, one_run_dir, page, relabel_examples, scrape)  # noqa: F401 - fixtures too


@pytest.mark.integration
def test_relabel_examples_pass_promtool(tmp_path):
    for i, rules in enumerate(relabel_examples()):
        config = {"global": {"scrape_interval": "15s"},
                  "scrape_configs": [{"job_name": "rankscope", "static_configs": [{"targets": ["node-0:9400"]}],
                                      "metric_relabel_configs": rules}]}
        path = tmp_path / f"example-{i}.yml"
        path.write_text(yaml.safe_dump(config))
        r = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["sum-count", "node-buckets"])
def test_promtool_check_metrics_accepts_the_page(one_run_dir, mode):
    text = Renderer().render(Frozen(collect(one_run_dir, mode))).decode()
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr   # parsed, and no lint advice


@pytest.mark.integration
@pytest.mark.parametrize("accept", ["", OPENMETRICS], ids=["text", "openmetrics"])
def test_real_exporters_in_each_mode(live_node, accept):
    full = page(live_node["full"].url, accept)
    per_rank_buckets = {k for k in full if k[0].endswith("_bucket") and "rank" in dict(k[1])}
    assert len({dict(k[1])["rank"] for k in per_rank_buckets}) == LIVE_RANKS
    assert {family_of(k[0]) for k in per_rank_buckets} == set(HISTOGRAMS)
    kept = {k: v for k, v in full.items() if k not in per_rank_buckets}
    for mode in ("sum-count", "node-buckets"):
        reduced = page(live_node[mode].url, accept)
        node = {k: v for k, v in reduced.items() if k[0].startswith(exporter_catalog.NODE_HISTOGRAM_PREFIX)}
        # Everything but the per-rank buckets, value for value; nothing else but the node histograms.
        assert {k: v for k, v in reduced.items() if k not in node} == kept, mode
        assert bool(node) == (mode == "node-buckets")
    # The node histograms: the sums of the ranks' series.
    sums: dict[tuple, float] = defaultdict(float)
    for (name, labels), v in full.items():
        if family_of(name) in HISTOGRAMS:
            rest = tuple(lv for lv in labels if lv[0] not in ("rank", "local_rank"))
            sums[(node_histogram_name(family_of(name)) + name[len(family_of(name)):], rest)] += float(v)
    node = {k: float(v) for k, v in page(live_node["node-buckets"].url, accept).items()
            if k[0].startswith(exporter_catalog.NODE_HISTOGRAM_PREFIX)}
    assert set(node) == set(sums)
    for k, v in node.items():
        assert v == (pytest.approx(sums[k], rel=1e-12) if k[0].endswith("_sum") else sums[k]), k
    # The type each mode declares.
    om = scrape(live_node["sum-count"].url, OPENMETRICS)
    assert "# TYPE rankscope_step_duration_seconds summary" in om
    assert "# TYPE rankscope_step_duration_seconds histogram" in scrape(live_node["full"].url, OPENMETRICS)


@pytest.mark.integration
def test_prometheus_scrapes_each_mode_and_the_relabelling(live_node):
    """Debian's Prometheus 2.42 (it asks for OpenMetrics first) scrapes the full and the node-buckets exporter of
    the same node, and the full one again through docs/scaling.md's first relabelling."""
    from tests.helpers.promstack import PrometheusServer

    def target(mode: str) -> dict:
        return {"targets": [f"127.0.0.1:{live_node[mode].port}"], "labels": {"instance": "node-live"}}

    config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
              "scrape_configs": [
                  {"job_name": "full", "static_configs": [target("full")]},
                  {"job_name": "node-buckets", "static_configs": [target("node-buckets")]},
                  {"job_name": "relabelled", "static_configs": [target("full")],
                   "metric_relabel_configs": relabel_examples()[0]}]}
    with PrometheusServer(config) as prom:
        prom.wait_for_scrape(timeout=60)

        def stored(job: str) -> dict[tuple, str]:
            out = {}
            for r in prom.query(f'{{job="{job}", __name__=~"rankscope_.+"}}'):
                labels = {k: v for k, v in r["metric"].items() if k not in ("job", "instance")}
                name = labels.pop("__name__")
                if family_of(name) not in TIME_DERIVED:
                    out[(name, tuple(sorted(labels.items())))] = r["value"][1]
            return out

        def every_job_stored():
            jobs = {job: stored(job) for job in ("full", "node-buckets", "relabelled")}
            return jobs if all(jobs.values()) else None

        jobs = prom.wait_for(every_job_stored, timeout=30, what="every job's series stored")
        full, reduced, relabelled = jobs["full"], jobs["node-buckets"], jobs["relabelled"]
        per_rank_buckets = {k for k in full if k[0].endswith("_bucket") and "rank" in dict(k[1])}
        assert per_rank_buckets and not [k for k in reduced if k[0].endswith("_bucket") and "rank" in dict(k[1])]
        node = {k for k in reduced if k[0].startswith(exporter_catalog.NODE_HISTOGRAM_PREFIX)}
        assert {k: v for k, v in reduced.items() if k not in node} == \
            {k: v for k, v in full.items() if k not in per_rank_buckets}
        # The relabelled full page: the same series as sum-count serves.
        assert set(relabelled) == set(full) - per_rank_buckets
        scraped = {r["metric"]["job"]: float(r["value"][1]) for r in prom.query("scrape_samples_scraped")}
        kept = {r["metric"]["job"]: float(r["value"][1]) for r in prom.query("scrape_samples_post_metric_relabeling")}
        assert scraped["relabelled"] - kept["relabelled"] == len(per_rank_buckets)
        assert scraped["full"] - scraped["node-buckets"] == len(per_rank_buckets) - len(node)
        # Run-wide step-time quantiles: the node histograms give what the ranks' buckets gave.
        for q in ("0.5", "0.9", "0.99"):
            ranks = prom.query(f'histogram_quantile({q}, sum by (run, le) '
                               f'(rankscope_step_duration_seconds_bucket{{job="full"}}))')
            nodes = prom.query(f'histogram_quantile({q}, sum by (run, le) '
                               f'(rankscope_node_step_duration_seconds_bucket{{job="node-buckets"}}))')
            either = [prom.query(f'histogram_quantile({q}, sum by (run, le) ({{__name__=~"rankscope_(node_)?step_'
                                 f'duration_seconds_bucket", job="{job}"}}))') for job in ("full", "node-buckets")]
            values = [[r["value"][1] for r in result] for result in (ranks, nodes, *either)]
            assert len(values[0]) == 1 and float(values[0][0]) > 0 and all(v == values[0] for v in values), values
        assert prom.query('count(rankscope_node_step_duration_seconds_count{job="node-buckets"})')[0]["value"][1] == "1"
