"""Static checks of rankscope's Prometheus rules and Alertmanager routing, with the real tools.

promtool/amtool are Debian's (Prometheus 2.42, Alertmanager 0.25). That the
committed rule files match prometheus/generate.py is checked with every other
generated file by tests/test_deploy.py (deploy/generate.py --check).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from rankscope.exporter.catalog import EXPORTER_METRICS
from prometheus import generate
from prometheus.rules_spec import ALERTS, RECORDING_RULES
from rankscope.contract.catalog import RANK_METRICS

ROOT = Path(__file__).resolve().parent.parent
PROM = ROOT / "prometheus"
RULE_FILES = [PROM / "rules" / "recording.yml", PROM / "rules" / "alerts.yml"]
RUNBOOK = ROOT / "docs" / "runbook.md"


def run(*cmd: str) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stdout}\n{result.stderr}"
    return result


def rendered_alerts() -> list[dict]:
    return yaml.safe_load((PROM / "rules" / "alerts.yml").read_text())["groups"][0]["rules"]


def test_promtool_check_rules():
    out = run("promtool", "check", "rules", *map(str, RULE_FILES)).stdout
    assert f"SUCCESS: {len(RECORDING_RULES)} rules found" in out
    assert f"SUCCESS: {len(ALERTS)} rules found" in out


def test_promtool_check_config():
    run("promtool", "check", "config", str(PROM / "prometheus.yml"))


def test_promtool_unit_tests_pass():
    tests = sorted(str(p) for p in (PROM / "tests").glob("*.yml"))
    assert tests
    run("promtool", "test", "rules", *tests)


def test_fast_variant_is_valid(tmp_path):
    generate.main(["--override", str(PROM / "fast.yaml"), "--out", str(tmp_path)])
    run("promtool", "check", "rules", *map(str, sorted(tmp_path.glob("*.yml"))))


def test_amtool_check_config():
    run("amtool", "check-config", str(PROM / "alertmanager.yml"))


@pytest.mark.parametrize("severity,receiver", [("critical", "pager"), ("warning", "chat"), ("info", "default")])
def test_each_severity_reaches_its_receiver(severity, receiver):
    run("amtool", "config", "routes", "test", f"--config.file={PROM / 'alertmanager.yml'}",
        f"--verify.receivers={receiver}", f"severity={severity}", "alertname=RankscopeTest", "run=r1")


def test_every_alert_has_severity_annotations_and_runbook_link():
    for rule in rendered_alerts():
        name = rule["alert"]
        assert re.fullmatch(r"Rankscope[A-Z][A-Za-z]+", name), name
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), name
        ann = rule["annotations"]
        assert ann["summary"] and ann["description"], name
        assert ann["runbook_url"].endswith("/docs/runbook.md#" + name.lower()), name


def test_every_alert_has_a_promtool_test():
    tested = set()
    for path in (PROM / "tests").glob("*.yml"):
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                if check.get("exp_alerts"):  # a firing expectation, not only a silent one
                    tested.add(check["alertname"])
    assert {a.alert for a in ALERTS} - tested == set()


def test_every_recording_rule_has_a_promtool_test():
    tested = set()
    for path in (PROM / "tests").glob("*.yml"):
        for case in yaml.safe_load(path.read_text())["tests"]:
            tested |= {check["expr"] for check in case.get("promql_expr_test", [])}
    assert {r.record for r in RECORDING_RULES} - tested == set()


def test_every_alert_has_a_runbook_section():
    # GitHub anchors of "## RankscopeFoo" headings are "#rankscopefoo".
    headings = {m.group(1).lower() for m in re.finditer(r"^#{2,3} (\w+)\s*$", RUNBOOK.read_text(), re.M)}
    assert {a.alert.lower() for a in ALERTS} - headings == set()


# Metric names in PromQL: identifiers left after removing matchers, ranges,
# strings and modifiers, that are not function calls or keywords.
_NOT_METRICS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
                "offset", "bool", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    expr = re.sub(r"\{[^}]*\}", "", expr)             # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)            # range selectors
    expr = re.sub(r"\"[^\"]*\"|`[^`]*`", "", expr)     # string literals
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"offset\s+\w+", "", expr)
    names = set()
    for m in re.finditer(r"([a-zA-Z_:][\w:]*)(\s*\()?", expr):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in _NOT_METRICS or re.fullmatch(r"\d.*", word):
            continue
        names.add(word)
    return names


def test_rules_use_only_catalog_metrics():
    allowed = {"up"} | {r.record for r in RECORDING_RULES}
    for spec in RANK_METRICS + EXPORTER_METRICS:
        allowed.add(spec.name)
        if spec.kind == "histogram":
            allowed |= {spec.name + s for s in ("_bucket", "_sum", "_count")}
    used = {}
    for group in (yaml.safe_load(p.read_text())["groups"][0] for p in RULE_FILES):
        for rule in group["rules"]:
            texts = [rule["expr"]] + [q for q in re.findall(r"printf `([^`]*)`", str(rule.get("annotations", {}))) if "%s" in q]
            for text in texts:
                for name in metric_names(text):
                    used.setdefault(name, rule.get("alert") or rule.get("record"))
    assert used, "parser found no metric names"
    unknown = {n: r for n, r in used.items() if n not in allowed}
    assert unknown == {}, f"metric names outside the catalogs: {unknown}"
    assert "rankscope_hang_suspect" in used and "rankscope_step_duration_seconds_sum" in used


@pytest.mark.integration  # starts Alertmanager
def test_inhibitions_in_a_real_alertmanager():
    """The shipped alertmanager.yml, run by Alertmanager 0.25: a dead rank silences its run's
    hang/stall/straggler alerts (not another run's), a critical silences its warning twin,
    and critical/warning reach the pager/chat webhooks."""
    import json
    import urllib.request

    from tests.helpers.promstack import AlertmanagerServer, WebhookReceiver, poll

    def alert(name: str, severity: str, run: str, rank: str) -> dict:
        return {"labels": {"alertname": name, "severity": severity, "run": run, "rank": rank, "node": "n0"},
                "annotations": {"summary": name}}

    with WebhookReceiver() as hook:
        config = yaml.safe_load((PROM / "alertmanager.yml").read_text())
        # group_wait 1s, not 0s: Alertmanager's inhibitor learns of new alerts
        # asynchronously, so a 0s flush can race it (seen here once in ~10 runs).
        config["route"].update(group_wait="1s", group_interval="1s")
        for route in config["route"]["routes"]:
            route["group_wait"] = "1s"
        for receiver in config["receivers"]:
            for webhook in receiver.get("webhook_configs", []):
                webhook["url"] = hook.url("/" + webhook["url"].rsplit("/", 1)[1])
        with AlertmanagerServer(config_text=yaml.safe_dump(config)) as am:
            posted = [
                alert("RankscopeRankDown", "critical", "r1", "1"),
                alert("RankscopeHangSuspect", "critical", "r1", "0"),
                alert("RankscopeRunStalled", "critical", "r1", "0"),
                alert("RankscopeStraggler", "warning", "r1", "0"),
                alert("RankscopeHangSuspect", "critical", "r2", "3"),       # another run: not inhibited
                alert("RankscopeInputBound", "warning", "r2", "3"),         # a warning that reaches chat
            ]
            req = urllib.request.Request(am.url + "/api/v2/alerts", data=json.dumps(posted).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
            urllib.request.urlopen(req, timeout=5).close()

            def states() -> dict:
                got = {(a["labels"]["alertname"], a["labels"]["run"]): a["status"]["state"] for a in am.alerts()}
                return got if len(got) == len(posted) else {}

            # Inhibition is evaluated lazily; poll until every alert has its final state.
            expected = {("RankscopeRankDown", "r1"): "active", ("RankscopeHangSuspect", "r1"): "suppressed",
                        ("RankscopeRunStalled", "r1"): "suppressed", ("RankscopeStraggler", "r1"): "suppressed",
                        ("RankscopeHangSuspect", "r2"): "active", ("RankscopeInputBound", "r2"): "active"}
            poll(lambda: states() == expected, timeout=15, what=f"alert states {expected}")
            page = hook.wait_for(lambda d: d.path == "/page" and any(
                a["labels"]["alertname"] == "RankscopeRankDown" for a in d.alerts), timeout=15)
            assert {a["labels"]["alertname"] for a in page.alerts} == {"RankscopeRankDown"}
            hook.wait_for(lambda d: d.path == "/chat" and any(
                a["labels"]["alertname"] == "RankscopeInputBound" for a in d.alerts), timeout=15)
            delivered = {(a["labels"]["alertname"], a["labels"]["run"]) for d in hook.snapshot() for a in d.alerts}
            assert ("RankscopeStraggler", "r1") not in delivered and ("RankscopeRunStalled", "r1") not in delivered
