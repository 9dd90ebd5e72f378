"""A healthy run pages nothing and captures no evidence: two minutes of realistic noise (step-time jitter of
+-20%, loss noise, evaluation pauses, a checkpoint pause, a clean stop at a
checkpoint and a restart from it) with the fast drill thresholds, the shipped
Alertmanager routes and a real webhook. The 10-minute version at the production
thresholds runs in the fault matrix (bash tests/run.sh --matrix)."""

from __future__ import annotations

import pytest

from tests.helpers.paging import FAST_NOISE, alertmanager_config, render_rules, run_healthy
from tests.helpers.promstack import AlertmanagerServer, WebhookReceiver

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_noisy_healthy_run_with_a_restart_pages_nothing_at_the_fast_thresholds(tmp_path):
    rules = render_rules(tmp_path / "rules", fast=True)
    with WebhookReceiver() as hook, AlertmanagerServer(config_text=alertmanager_config(hook)) as am:
        outcome = run_healthy(rules, am, hook, tmp_path, seconds=120.0, noise=FAST_NOISE)
    assert outcome.error is None and outcome.trained_through_the_restart(), outcome.describe()
    assert outcome.delivered == [], outcome.describe()
    assert outcome.prometheus_firing == [], outcome.describe()
    assert outcome.evidence == [], outcome.describe()   # and its exporter captured nothing
