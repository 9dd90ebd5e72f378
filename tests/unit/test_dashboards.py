"""Static checks of the Grafana dashboards and provisioning (no Grafana server can run here).

What this proves:
- (the committed JSON is exactly what grafana/generate.py produces: checked
  with every generated file by tests/unit/test_deploy.py, deploy/generate.py --check);
- each dashboard loads into the Foundation SDK's typed models, and re-encoding
  the models gives the same JSON (nothing unknown or lost);
- uids are stable and unique, panel ids unique, every panel has a unit and a
  description, every range window is $__rate_interval, every query goes
  through the ${datasource} variable and is scoped to $run;
- every metric name used is in the catalogs (plus _bucket/_sum/_count), a
  recording rule in prometheus/rules/, or Prometheus's ALERTS series;
- the provisioning YAML is valid, has the fixed datasource uids the
  dashboards use, and its provider reads the folder the docs mount.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from rankscope.exporter.catalog import EXPORTER_METRICS
from grafana import generate
from rankscope.contract.catalog import RANK_METRICS

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS_DIR = ROOT / "grafana" / "dashboards"
PROVISIONING = ROOT / "grafana" / "provisioning"
RULES_DIR = ROOT / "prometheus" / "rules"

EXPECTED_UIDS = {
    "rankscope-run-overview",
    "rankscope-ranks",
    "rankscope-communication",
    "rankscope-memory-devices",
}
VARIABLES = ("datasource", "run", "node", "rank")
# Series Prometheus itself creates from alerting rules.
PROMETHEUS_BUILTINS = {"ALERTS", "ALERTS_FOR_STATE"}

PROMQL_WORDS = {
    # aggregations, functions and keywords that look like identifiers
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile", "count_values",
    "group", "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
    "offset", "rate", "irate", "increase", "delta", "idelta", "deriv", "histogram_quantile", "label_replace",
    "label_join", "scalar", "vector", "sort", "sort_desc", "abs", "clamp_min", "clamp_max", "time",
    "timestamp", "max_over_time", "min_over_time", "avg_over_time", "last_over_time", "changes", "resets",
    "absent", "inf", "nan",
}


# ---------------------------------------------------------------- helpers

def load_dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS_DIR.glob("*.json"))}


def panels(dashboard: dict) -> list[dict]:
    """Every non-row panel, including panels nested in collapsed rows."""
    out = []
    for p in dashboard.get("panels", []):
        if p.get("type") == "row":
            out.extend(p.get("panels", []))
        else:
            out.append(p)
    return out


def panel_exprs(dashboard: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in panels(dashboard) for t in p.get("targets", [])]


def variable_queries(dashboard: dict) -> list[tuple[str, str]]:
    out = []
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]
            out.append((v["name"], q["query"] if isinstance(q, dict) else q))
    return out


def strip_label_values(expr: str) -> str:
    m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", expr.strip())
    return m.group(1) if m else expr


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (strings, matchers, windows and grouping labels removed)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', strip_label_values(expr))
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        word = m.group(0)
        followed_by_call = e[m.end():].lstrip().startswith("(")
        if word.lower() in PROMQL_WORDS or followed_by_call or word.startswith("__"):
            continue
        if re.fullmatch(r"e\d*", word):  # exponent of a number such as 1e-9
            continue
        names.add(word)
    return names


def recording_rules() -> set[str]:
    names = set()
    for path in sorted(RULES_DIR.glob("*.y*ml")):
        for group in (yaml.safe_load(path.read_text()) or {}).get("groups", []):
            names.update(r["record"] for r in group.get("rules", []) if "record" in r)
    return names


def allowed_metric_names() -> set[str]:
    names = set(PROMETHEUS_BUILTINS) | recording_rules()
    for spec in RANK_METRICS + EXPORTER_METRICS:
        names.add(spec.name)
        if spec.kind == "histogram":
            names.update(spec.name + suffix for suffix in ("_bucket", "_sum", "_count"))
    return names


DASHBOARDS = load_dashboards()


# ---------------------------------------------------------------- tests

def test_generator_makes_exactly_the_committed_dashboards():
    assert {p.name for p in generate.outputs()} == set(DASHBOARDS)
    assert {p.parent for p in generate.outputs()} == {DASHBOARDS_DIR}


def test_expected_dashboards_with_stable_unique_uids():
    uids = [d["uid"] for d in DASHBOARDS.values()]
    assert sorted(uids) == sorted(EXPECTED_UIDS)
    for name, d in DASHBOARDS.items():
        assert name == f"{d['uid']}.json"
        assert len(d["uid"]) <= 40  # Grafana's limit
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_dashboard_loads_into_sdk_models(name):
    text = (DASHBOARDS_DIR / name).read_text()
    model = generate.load(text)
    assert model.uid == DASHBOARDS[name]["uid"]
    assert model.schema_version >= 39  # a Grafana 11 schema
    # Every panel parsed into its plugin's typed options, every query into the Prometheus model.
    for panel in model.panels:
        if panel.type_val == "row":
            continue
        assert not isinstance(panel.options, dict), f"{panel.title}: options not typed"
        for target in panel.targets or []:
            assert type(target).__module__.endswith("models.prometheus"), f"{panel.title}: {type(target)}"
    # Re-encoding the models gives the committed JSON back: nothing was unknown or dropped.
    assert json.loads(generate.encode(model)) == DASHBOARDS[name]


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_every_panel_has_unit_description_and_queries(name):
    d = DASHBOARDS[name]
    assert panels(d), name
    for p in panels(d):
        assert p["fieldConfig"]["defaults"].get("unit"), f"{name}: {p['title']} has no unit"
        assert p.get("description"), f"{name}: {p['title']} has no description"
        assert p.get("targets"), f"{name}: {p['title']} has no query"
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        for t in p["targets"]:
            assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_variables_scope_every_query(name):
    d = DASHBOARDS[name]
    assert [v["name"] for v in d["templating"]["list"]] == list(VARIABLES)
    ds = d["templating"]["list"][0]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    assert ds["current"]["value"] == generate.PROMETHEUS_UID
    for title, expr in panel_exprs(d):
        assert "$run" in expr, f"{title}: not scoped to the run: {expr}"
        # Alerts and run-, stage- or group-level recording rules (run:..., run_phase:..., stage:...,
        # group:...) have no node/rank.
        per_rank = {m for m in metric_names(expr) - PROMETHEUS_BUILTINS
                    if not m.startswith(("run:", "run_", "stage:", "group:"))}
        if per_rank:
            assert "$rank" in expr and "$node" in expr, f"{title}: not scoped to node/rank: {expr}"


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_every_range_window_is_rate_interval(name):
    for title, expr in panel_exprs(DASHBOARDS[name]):
        for window in re.findall(r"\[([^\]]*)\]", expr):
            assert window == "$__rate_interval", f"{title}: window [{window}] in {expr}"
        for fn in re.findall(r"\b(rate|irate|increase)\(", expr):
            assert "[$__rate_interval]" in expr, f"{title}: {fn} without $__rate_interval"


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_only_catalog_metrics_and_recording_rules(name):
    allowed = allowed_metric_names()
    queries = panel_exprs(DASHBOARDS[name]) + variable_queries(DASHBOARDS[name])
    seen = set()
    for title, expr in queries:
        used = metric_names(expr)
        assert used, f"{title}: no metric found in {expr}"
        assert used <= allowed, f"{title}: unknown metric(s) {sorted(used - allowed)}"
        seen |= used
    assert seen


def test_metric_name_extraction():
    expr = ('histogram_quantile(0.99, sum by (le) (rate(rankscope_step_duration_seconds_bucket'
            '{run="$run", node=~"a|b"}[$__rate_interval]))) / on (node) group_left (rank) '
            'run:rankscope_x:sum or label_replace(up{a="rate(x)"}, "u", "$1", "g", "(.+)") > 1e-9')
    assert metric_names(expr) == {"rankscope_step_duration_seconds_bucket", "run:rankscope_x:sum", "up"}
    assert metric_names('label_values(rankscope_rank_up{run="$run"}, node)') == {"rankscope_rank_up"}


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_links_to_other_dashboards_runbook_and_traces(name):
    d = DASHBOARDS[name]
    assert generate.TAG in d["tags"]
    by_type = {}
    for link in d["links"]:
        by_type.setdefault(link["type"], []).append(link)
    (dash_link,) = by_type["dashboards"]
    assert dash_link["tags"] == [generate.TAG] and dash_link["includeVars"] and dash_link["keepTime"]
    urls = [link["url"] for link in by_type["link"]]
    assert any(u.endswith("docs/runbook.md") for u in urls)
    assert any(u.startswith("/explore?") and generate.TEMPO_UID in u for u in urls)


def test_datasource_provisioning():
    doc = yaml.safe_load((PROVISIONING / "datasources" / "rankscope.yaml").read_text())
    assert doc["apiVersion"] == 1
    by_type = {ds["type"]: ds for ds in doc["datasources"]}
    assert set(by_type) == {"prometheus", "alertmanager", "tempo"}
    assert by_type["prometheus"]["uid"] == generate.PROMETHEUS_UID
    assert by_type["prometheus"]["isDefault"] is True
    assert by_type["tempo"]["uid"] == generate.TEMPO_UID
    assert by_type["alertmanager"]["jsonData"]["implementation"] == "prometheus"
    uids = [ds["uid"] for ds in doc["datasources"]]
    assert len(uids) == len(set(uids))
    for ds in doc["datasources"]:
        assert ds["url"].startswith("http"), ds["name"]


def test_dashboard_provider_reads_the_documented_folder():
    doc = yaml.safe_load((PROVISIONING / "dashboards" / "rankscope.yaml").read_text())
    assert doc["apiVersion"] == 1
    (provider,) = doc["providers"]
    assert provider["type"] == "file"
    path = provider["options"]["path"]
    assert path.startswith("/var/lib/grafana/dashboards")
    # The docs tell operators to mount grafana/dashboards exactly there.
    docs = (ROOT / "docs" / "dashboards.md").read_text()
    assert f"grafana/dashboards:{path}" in docs
    assert "grafana/provisioning:/etc/grafana/provisioning" in docs
