"""A healthy run pages nothing and captures no evidence: two minutes of realistic noise (step-time jitter of
+-20%, loss noise, evaluation pauses, a checkpoint pause that rank 0 spends saving while the
other rank waits for it in a barrier, a clean stop at a checkpoint and a restart from it) with
the fast drill thresholds, the shipped Alertmanager routes and a real webhook. The 10-minute
version at the production thresholds runs in the fault matrix (bash tests/run.sh --matrix); the
30-minute one, with a 2-minute checkpoint and a 3-minute evaluation, is the soak
(bash tests/run.sh --soak: longer than the matrix's 20 minutes may take)."""

from __future__ import annotations

import pytest

from tests.helpers.paging import FAST_NOISE, SOAK_NOISE, alertmanager_config, render_rules, run_healthy
from tests.helpers.promstack import AlertmanagerServer, WebhookReceiver

pytestmark = [pytest.mark.slow]

SOAK_SECONDS = 1800.0


@pytest.mark.timeout(600)
def test_a_noisy_healthy_run_with_a_restart_pages_nothing_at_the_fast_thresholds(tmp_path):
    rules = render_rules(tmp_path / "rules", fast=True)
    with WebhookReceiver() as hook, AlertmanagerServer(config_text=alertmanager_config(hook)) as am:
        outcome = run_healthy(rules, am, hook, tmp_path, seconds=120.0, noise=FAST_NOISE)
    assert outcome.error is None and outcome.trained_through_the_restart(), outcome.describe()
    assert outcome.delivered == [], outcome.describe()
    assert outcome.prometheus_firing == [], outcome.describe()
    assert outcome.evidence == [], outcome.describe()   # and its exporter captured nothing


@pytest.mark.soak
@pytest.mark.timeout(SOAK_SECONDS + 900)
def test_a_thirty_minute_noisy_healthy_run_pages_nothing_at_the_production_settings(tmp_path):
    """Scraped and evaluated every 15 s (the hang and liveness groups every 5 s), with the shipped
    rules and routes: 2-minute checkpoints on rank 0 (the other rank waits in a barrier), 3-minute
    evaluations, +-20% step jitter, a stop and a restart. Nothing is delivered, nothing fires,
    nothing is captured."""
    rules = render_rules(tmp_path / "rules", fast=False)
    with WebhookReceiver() as hook, AlertmanagerServer(config_text=alertmanager_config(hook)) as am:
        outcome = run_healthy(rules, am, hook, tmp_path, seconds=SOAK_SECONDS, noise=SOAK_NOISE,
                              scrape_interval="15s")
    print(outcome.describe())
    assert outcome.error is None and outcome.trained_through_the_restart(), outcome.describe()
    assert outcome.delivered == [], outcome.describe()
    assert outcome.prometheus_firing == [], outcome.describe()
    assert outcome.evidence == [], outcome.describe()
