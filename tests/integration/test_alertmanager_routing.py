"""The shipped routing in a real Alertmanager (the static checks: tests/unit/test_rules.py)."""

from __future__ import annotations
import pytest
import yaml
from prometheus import generate
from prometheus.rules_spec import ALERTS

from tests.unit.test_rules import (PROM, _EARLIER, _post_alerts, _webhooks_to, run)  # noqa: F401 - fixtures too


@pytest.mark.integration  # starts Alertmanager
def test_inhibitions_in_a_real_alertmanager():
    """The shipped alertmanager.yml, run by Alertmanager 0.25: a dead rank silences its run's
    hang/stall/straggler alerts (not another run's), a lost node silences its run's torn-down
    ranks and its exporter's TargetDown, an OOM its run's RankDown, a critical silences its
    warning twin, and critical/warning reach the pager/chat webhooks."""
    from tests.helpers.promstack import AlertmanagerServer, WebhookReceiver, poll

    def alert(name: str, severity: str, run: str, rank: str, **extra: str) -> dict:
        labels = {"alertname": name, "severity": severity, "run": run, "rank": rank, "node": "n0", **extra}
        return {"labels": {k: v for k, v in labels.items() if v}, "annotations": {"summary": name}}

    with WebhookReceiver() as hook:
        config = _webhooks_to(hook, yaml.safe_load((PROM / "alertmanager.yml").read_text()))
        # group_wait 1s, not 0s: Alertmanager's inhibitor learns of new alerts
        # asynchronously, so a 0s flush can race it (seen here once in ~10 runs).
        config["route"].update(group_wait="1s", group_interval="1s")
        for route in config["route"]["routes"]:
            route["group_wait"] = "1s"
        with AlertmanagerServer(config_text=yaml.safe_dump(config)) as am:
            posted = [
                alert("RankscopeRankDown", "critical", "r1", "1"),
                alert("RankscopeHangSuspect", "critical", "r1", "0"),
                alert("RankscopeRunStalled", "critical", "r1", "0"),
                alert("RankscopeStraggler", "warning", "r1", "0"),
                alert("RankscopeHangSuspect", "critical", "r2", "3"),       # another run: not inhibited
                alert("RankscopeInputBound", "warning", "r2", "3"),         # a warning that reaches chat
                # r3 lost node n1 (ranks 2, 3); its rank 0 on n0 was torn down
                alert("RankscopeNodeLost", "critical", "r3", "2", node="n1", instance="n1:9400"),
                alert("RankscopeRankDown", "critical", "r3", "0", instance="n0:9400"),
                alert("RankscopeTargetDown", "warning", "r3", "", node="n1", instance="n1:9400"),
                alert("RankscopeTargetDown", "warning", "", "", node="n9", instance="n9:9400"),   # another exporter
                # r4: rank 1 ran out of memory and died; the launcher tore rank 0 down
                alert("RankscopeOutOfMemory", "critical", "r4", "1"),
                alert("RankscopeRankDown", "critical", "r4", "1"),
                alert("RankscopeRankDown", "critical", "r4", "0"),
            ]
            _post_alerts(am, posted)

            def key(labels: dict) -> tuple:
                return labels["alertname"], labels.get("run", ""), labels.get("rank", ""), labels.get("instance", "")

            def states() -> dict:
                got = {key(a["labels"]): a["status"]["state"] for a in am.alerts()}
                return got if len(got) == len(posted) else {}

            suppressed = {("RankscopeHangSuspect", "r1", "0", ""), ("RankscopeRunStalled", "r1", "0", ""),
                          ("RankscopeStraggler", "r1", "0", ""), ("RankscopeRankDown", "r3", "0", "n0:9400"),
                          ("RankscopeTargetDown", "r3", "", "n1:9400"), ("RankscopeRankDown", "r4", "1", ""),
                          ("RankscopeRankDown", "r4", "0", "")}
            expected = {key(a["labels"]): "suppressed" if key(a["labels"]) in suppressed else "active"
                        for a in posted}
            # Inhibition is evaluated lazily; poll until every alert has its final state.
            poll(lambda: states() == expected, timeout=15, what=f"alert states {expected}")
            page = hook.wait_for(lambda d: d.path == "/page" and any(
                a["labels"]["alertname"] == "RankscopeRankDown" for a in d.alerts), timeout=15)
            assert {a["labels"]["alertname"] for a in page.alerts} == {"RankscopeRankDown"}
            for name, path in (("RankscopeInputBound", "/chat"), ("RankscopeNodeLost", "/page"),
                               ("RankscopeOutOfMemory", "/page"), ("RankscopeTargetDown", "/chat")):
                hook.wait_for(lambda d: d.path == path and any(
                    a["labels"]["alertname"] == name for a in d.alerts), timeout=15)
            delivered = {key(a["labels"]) for d in hook.snapshot() for a in d.alerts}
            assert delivered & suppressed == set(), delivered & suppressed


@pytest.mark.integration  # starts Alertmanager
def test_every_alert_is_delivered_firing_within_group_wait_with_the_shipped_timing():
    """With the shipped group_wait/group_interval (not the drills' 1 s), each alert that fires in a
    run that has already been notified is delivered firing within group_wait of reaching
    Alertmanager: it starts its own group (grouped by run and alert name) instead of waiting
    for the run group's next group_interval, and nothing arrives only as "resolved"."""
    import time

    from tests.helpers.promstack import AlertmanagerServer, WebhookReceiver

    config_text = (PROM / "alertmanager.yml").read_text()
    route = yaml.safe_load(config_text)["route"]
    wait = {sub["matchers"][0].split("=")[1].strip('"'): generate.duration_seconds(sub.get("group_wait", route["group_wait"]))
            for sub in route["routes"]}
    path = {"critical": "/page", "warning": "/chat"}

    def alert(name: str, severity: str, run: str) -> dict:
        return {"labels": {"alertname": name, "severity": severity, "run": run, "rank": "1", "node": "n0",
                           "instance": f"{run}:9400"}, "annotations": {"summary": name}}

    with WebhookReceiver() as hook:
        config = _webhooks_to(hook, yaml.safe_load(config_text))
        with AlertmanagerServer(config_text=yaml.safe_dump(config)) as am:
            runs = {a.alert: f"d-{i}" for i, a in enumerate(ALERTS)}
            _post_alerts(am, [alert(_EARLIER, a.severity, runs[a.alert]) for a in ALERTS])
            for a in ALERTS:   # every run's group has been notified once
                hook.wait_for(lambda d, a=a: any(x["labels"]["run"] == runs[a.alert] for x in d.alerts),
                              timeout=wait[a.severity] + 15)
            posted_at = time.monotonic()
            _post_alerts(am, [alert(a.alert, a.severity, runs[a.alert]) for a in ALERTS])
            late = {}
            for a in ALERTS:
                deadline = wait[a.severity] + 4 - (time.monotonic() - posted_at)
                try:
                    hook.wait_for(lambda d, a=a: d.path == path[a.severity] and any(
                        x["labels"]["alertname"] == a.alert and x["status"] == "firing" for x in d.alerts),
                        timeout=max(deadline, 0.1))
                except TimeoutError:
                    late[a.alert] = f"not delivered firing within group_wait {wait[a.severity]:g} s + 4 s"
            assert late == {}, late
            resolved_only = [x["labels"]["alertname"] for d in hook.snapshot() for x in d.alerts
                             if x["status"] == "resolved"]
            assert resolved_only == []
