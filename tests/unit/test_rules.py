"""Static checks of rankscope's Prometheus rules and Alertmanager routing, with the real tools.

promtool/amtool are Debian's (Prometheus 2.42, Alertmanager 0.25). That the
committed rule files match prometheus/generate.py is checked with every other
generated file by tests/unit/test_deploy.py (deploy/generate.py --check).
"""

from __future__ import annotations

import re
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from rankscope.exporter.catalog import EXPORTER_METRICS
from prometheus import generate
from prometheus.rules_spec import ALERTS, HANG, PAGING, RECORDING_RULES, RULE_GROUPS, SLOW, WARNING, rule_key
from rankscope.contract.catalog import RANK_METRICS

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "prometheus"
RULE_FILES = [PROM / "rules" / "recording.yml", PROM / "rules" / "alerts.yml"]
RUNBOOK = ROOT / "docs" / "runbook.md"


def run(*cmd: str) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stdout}\n{result.stderr}"
    return result


def rules_of(path: Path) -> list[dict]:
    return [r for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"]]


def rendered_alerts() -> list[dict]:
    return [r for r in rules_of(PROM / "rules" / "alerts.yml") if "alert" in r]


def test_promtool_check_rules():
    out = run("promtool", "check", "rules", *map(str, RULE_FILES)).stdout
    counts = [len(rules_of(p)) for p in RULE_FILES]
    assert sum(counts) == len(RECORDING_RULES) + len(ALERTS)
    for n in counts:
        assert f"SUCCESS: {n} rules found" in out


def test_promtool_check_config():
    run("promtool", "check", "config", str(PROM / "prometheus.yml"))


_promtool_runs: list[Future] = []


def start_promtool_tests() -> None:
    """promtool on every test file, two at a time, in the background: tests/conftest.py starts them once
    collection is done, so that they run beside the Python tests (the fast tier has a minute on two
    cores, and promtool's ~13 s are mostly its own process's)."""
    if _promtool_runs:
        return
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="promtool")
    tests = sorted((PROM / "tests").glob("*.yml"), key=lambda p: -p.stat().st_size)   # the longest first
    _promtool_runs.extend(pool.submit(run, "promtool", "test", "rules", str(path)) for path in tests)
    pool.shutdown(wait=False)


def test_promtool_unit_tests_pass():
    start_promtool_tests()   # already started, unless this test runs alone
    assert len(_promtool_runs) == len(list((PROM / "tests").glob("*.yml"))) > 0
    for future in _promtool_runs:
        future.result(timeout=300)


def test_fast_variant_is_valid(tmp_path):
    generate.main(["--override", str(PROM / "fast.yaml"), "--out", str(tmp_path)])
    run("promtool", "check", "rules", *map(str, sorted(tmp_path.glob("*.yml"))))


def _groups(*paths: Path) -> list[dict]:
    return [g for p in paths for g in yaml.safe_load(p.read_text())["groups"]]


def test_rule_groups_are_rendered_in_order_with_their_intervals(tmp_path):
    """RULE_GROUPS, in order, record-only groups in recording.yml; the hang and liveness groups
    every 5 s, the other paging groups at Prometheus's global interval, most warnings' every 30 s,
    the slow ones (dashboard summaries, long-window warnings) every minute; every group evaluates
    every second in the fast variant."""
    groups = _groups(*RULE_FILES)
    assert [g["name"] for g in groups] == [g.name for g in RULE_GROUPS]
    assert all("alert" not in r for g in _groups(RULE_FILES[0]) for r in g["rules"])
    assert all(any("alert" in r for r in g["rules"]) for g in _groups(RULE_FILES[1]))
    assert {g["name"]: g.get("interval") for g in groups if g.get("interval")} == {
        "rankscope.recording.steps": "30s", "rankscope.recording.phases": "30s",
        "rankscope.recording.phase_fractions": "30s", "rankscope.recording.goodput_memory": "30s",
        "rankscope.alerts.spikes": "30s", "rankscope.alerts.memory": "30s", "rankscope.alerts.bottlenecks": "30s",
        "rankscope.recording.slow": "1m", "rankscope.recording.summaries": "1m",
        "rankscope.recording.process_groups": "1m", "rankscope.alerts.slow": "1m",
        "rankscope.recording.liveness": "5s", "rankscope.alerts.hangs": "5s", "rankscope.alerts.liveness": "5s"}
    generate.main(["--override", str(PROM / "fast.yaml"), "--out", str(tmp_path)])
    fast = _groups(tmp_path / generate.RECORDING_FILE, tmp_path / generate.ALERTS_FILE)
    assert [g.get("interval") for g in fast] == ["1s"] * len(RULE_GROUPS)


def _reads(expr: str, record: str) -> bool:
    return re.search(rf"(?<![\w:]){re.escape(record)}(?![\w:])", expr) is not None


def test_a_record_read_in_its_own_group_is_evaluated_before_its_readers():
    """Within a group rules run in order: a rule reading a record of its own group must come
    after it, or it reads the previous evaluation's value."""
    for group in _groups(*RULE_FILES):
        defined_later = {r["record"] for r in group["rules"] if "record" in r}
        for rule in group["rules"]:
            if "record" in rule:
                defined_later.discard(rule["record"])
            early = {rec for rec in defined_later if _reads(rule["expr"], rec)}
            assert not early, (group["name"], rule.get("alert") or rule.get("record"), early)


_FOR_AT_LEAST = {HANG: 0, PAGING: 0, WARNING: 0, SLOW: 600}   # seconds of `for:` an alert needs in such a group


def _causes_read(expr: str) -> set[str] | None:
    """The causes a rule reads from run:rankscope_cause:present (None: none; all when unfiltered)."""
    reads = re.findall(r"run:rankscope_cause:present(\{[^}]*\})?", expr)
    if not reads:
        return None
    causes: set[str] = set()
    every = {dict(r.labels)["cause"] for r in RECORDING_RULES if r.record == "run:rankscope_cause:present"}
    for matcher in reads:
        m = re.search(r'cause=~?"([^"]*)"', matcher)
        causes |= {c for c in every if re.fullmatch(m.group(1), c)} if m else every
    return causes


def test_no_page_waits_on_a_less_frequent_group():
    """A critical alert evaluates at the paging interval or the hang interval (more often), and so
    does every record it reads, directly or through other records; one of the hang groups reads
    only records of the hang groups (its page must not wait on a 15 s record). Warnings (chat) may
    evaluate every 30 s; those of the 1 m groups wait 10 m or more anyway (their `for:`), so the
    minute is a fraction of it."""
    config = generate.load_thresholds()
    interval_of = {}   # record name (a cause as run:rankscope_cause:present{cause}) -> interval key
    for group in RULE_GROUPS:
        for key in group.rules:
            interval_of[key] = group.interval
    exprs = {rule_key(r): r.expr for r in (*RECORDING_RULES, *ALERTS)}

    def records_read(key: str) -> set[str]:
        expr = exprs[key]
        read = {k for k in exprs if ":" in k and "{" not in k and k != key and _reads(expr, k)}
        causes = _causes_read(expr)
        return read | {f"run:rankscope_cause:present{{{c}}}" for c in (causes or ())}

    for alert in ALERTS:
        group = interval_of[alert.alert]
        assert generate.duration_seconds(config["for"][alert.alert]) >= _FOR_AT_LEAST[group], alert.alert
        if alert.severity != "critical":
            continue
        assert group in (PAGING, HANG), alert.alert
        allowed = (HANG,) if group == HANG else (PAGING, HANG)
        seen, todo = set(), records_read(alert.alert)
        while todo:
            record = todo.pop()
            seen.add(record)
            assert interval_of[record] in allowed, (alert.alert, record)
            todo |= records_read(record) - seen


def test_gpu_alerts_join_the_rank_map_of_their_own_group():
    """The GPU-to-rank map is recorded once per evaluation, in the group of the alerts that join
    it and before them, so they see it in the same evaluation (no alert re-derives it)."""
    for group in _groups(*RULE_FILES):
        maps = [r["record"] for r in group["rules"] if r.get("record", "").startswith("uuid:")]
        for rule in group["rules"]:
            if "alert" in rule and rule["alert"].startswith("RankscopeGPU"):
                assert "label_replace(rankscope_rank_info" not in rule["expr"], rule["alert"]
                assert any(_reads(rule["expr"], m) for m in maps), (group["name"], rule["alert"])


def test_promtool_tests_evaluate_the_groups_in_their_order():
    """promtool evaluates groups in group_eval_order at each step: the rendered order, records
    first, as Prometheus's alerts read other groups' records at most one evaluation late."""
    order = [g.name for g in RULE_GROUPS]
    for path in sorted((PROM / "tests").glob("*.yml")):
        doc = yaml.safe_load(path.read_text())
        assert doc.get("group_eval_order") == order, path.name
        assert sorted(doc["rule_files"]) == ["../rules/alerts.yml", "../rules/recording.yml"], path.name


def test_keep_firing_for_is_rendered_and_valid(tmp_path):
    """keep_firing_for (Prometheus >= 2.42) reaches the rule files, production and fast."""
    config = generate.load_thresholds()
    rules = {r["alert"]: r for r in rendered_alerts()}
    assert config["keep_firing_for"] and set(config["keep_firing_for"]) <= set(rules)
    for name, value in config["keep_firing_for"].items():
        assert rules[name]["keep_firing_for"] == value, name
    generate.main(["--override", str(PROM / "fast.yaml"), "--out", str(tmp_path)])
    fast = {r["alert"]: r for r in rules_of(tmp_path / generate.ALERTS_FILE) if "alert" in r}
    assert all("keep_firing_for" in fast[name] for name in config["keep_firing_for"])


@pytest.mark.parametrize("fire,hold,direction", [
    ("straggler_ratio", "straggler_hold_ratio", "above"),
    ("input_bound_ratio", "input_bound_hold_ratio", "above"),
    ("comm_bound_ratio", "comm_bound_hold_ratio", "above"),
    ("throughput_drop_ratio", "throughput_drop_hold_ratio", "below"),
    ("memory_headroom_min_ratio", "memory_headroom_hold_ratio", "below"),
    ("gpu_util_min_ratio", "gpu_util_hold_ratio", "below"),
    ("goodput_min_ratio", "goodput_hold_ratio", "below"),
])
def test_hysteresis_hold_bars_lie_on_the_safe_side(fire, hold, direction):
    """An alert that fires above (below) a bar holds while above (below) a LOWER (HIGHER) one."""
    for path in (None, PROM / "fast.yaml"):
        params = (generate.load_thresholds(path) if path else generate.load_thresholds())["params"]
        if direction == "above":
            assert params[hold] < params[fire], (path, fire, hold)
        else:
            assert params[hold] > params[fire], (path, fire, hold)


def test_straggler_threshold_separates_a_1_5x_rank_from_20_percent_jitter():
    """The documented reasoning of thresholds.yaml: 1.5x fires; a persistent 1.2x rank and the
    0.8/1.0/1.2 spread (1.2 / median(0.8, 1.0) = 1.33) stay quiet (promtool: straggler_test.yml)."""
    params = generate.load_thresholds()["params"]
    assert 1.2 / 0.9 < params["straggler_ratio"] < 1.5
    assert params["straggler_min_excess_seconds"] <= 0.001


def test_amtool_check_config():
    run("amtool", "check-config", str(PROM / "alertmanager.yml"))


@pytest.mark.parametrize("severity,receiver", [("critical", "pager"), ("warning", "chat"), ("info", "default")])
def test_each_severity_reaches_its_receiver(severity, receiver):
    run("amtool", "config", "routes", "test", f"--config.file={PROM / 'alertmanager.yml'}",
        f"--verify.receivers={receiver}", f"severity={severity}", "alertname=RankscopeTest", "run=r1")


def test_every_route_groups_by_run_and_alert_name():
    """A new cause in a run starts its own group (delivered after group_wait), instead of joining
    the run's group and waiting for its group_interval (docs/alerting.md, "Delivery")."""
    route = yaml.safe_load((PROM / "alertmanager.yml").read_text())["route"]
    assert set(route["group_by"]) == {"run", "alertname"}
    for sub in route["routes"]:
        assert set(sub.get("group_by", route["group_by"])) == {"run", "alertname"}
        assert "group_interval" not in sub   # the drills shorten the root's only


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


def promtool_test_names() -> set[str]:
    return {case["name"] for path in (PROM / "tests").glob("*.yml")
            for case in yaml.safe_load(path.read_text())["tests"] if case.get("name")}


def test_time_to_page_table_names_promtool_tests_and_every_alert():
    """docs/alerting.md's production time-to-page table: each row is checked by the promtool
    test it names, and every alert has a row."""
    text = (ROOT / "docs" / "alerting.md").read_text()
    table = text.split("<!-- time-to-page:start -->", 1)[1].split("<!-- time-to-page:end -->", 1)[0]
    rows = [line for line in table.splitlines()
            if line.startswith("| ") and not line.startswith("| fault") and not set(line) <= set("|- ")]
    assert rows
    names = promtool_test_names()
    alerts_in_table = set()
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        quoted = re.findall(r"“([^”]+)”", cells[-1])
        assert quoted, f"no promtool test named in {row!r}"
        for name in quoted:
            assert name in names, f"{name!r} is not a promtool test"
        alerts_in_table |= set(re.findall(r"Rankscope[A-Za-z]+", cells[1]))
    assert {a.alert for a in ALERTS} - alerts_in_table == set()


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
    expr = re.sub(r"%[-+ #0]*\d*(\.\d+)?[a-zA-Z]", "", expr)   # a template's printf verbs (%s, %.0f)
    names = set()
    for m in re.finditer(r"([a-zA-Z_:][\w:]*)(\s*\()?", expr):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in _NOT_METRICS or re.fullmatch(r"\d.*", word):
            continue
        names.add(word)
    return names


def test_rules_use_only_catalog_metrics():
    # ALERTS: Prometheus's own series of pending/firing alerts (hysteresis, causes present).
    allowed = {"up", "ALERTS"} | {r.record for r in RECORDING_RULES}
    for spec in RANK_METRICS + EXPORTER_METRICS:
        allowed.add(spec.name)
        if spec.kind == "histogram":
            allowed |= {spec.name + s for s in ("_bucket", "_sum", "_count")}
    used = {}
    for group in (g for p in RULE_FILES for g in yaml.safe_load(p.read_text())["groups"]):
        for rule in group["rules"]:
            texts = [rule["expr"]] + [q for q in re.findall(r"printf `([^`]*)`", str(rule.get("annotations", {}))) if "%s" in q]
            for text in texts:
                for name in metric_names(text):
                    used.setdefault(name, rule.get("alert") or rule.get("record"))
    assert used, "parser found no metric names"
    unknown = {n: r for n, r in used.items() if n not in allowed}
    assert unknown == {}, f"metric names outside the catalogs: {unknown}"
    assert "rankscope_hang_suspect" in used and "rankscope_step_duration_seconds_sum" in used


def _post_alerts(am, alerts: list[dict]) -> None:
    import json
    import urllib.request

    req = urllib.request.Request(am.url + "/api/v2/alerts", data=json.dumps(alerts).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    urllib.request.urlopen(req, timeout=5).close()


def _webhooks_to(hook, config: dict) -> dict:
    for receiver in config["receivers"]:
        for webhook in receiver.get("webhook_configs", []):
            webhook["url"] = hook.url("/" + webhook["url"].rsplit("/", 1)[1])
    return config


# The alert that opens each run's groups before the cause fires (same route, no inhibition).
_EARLIER = "RankscopeEarlierAlert"


