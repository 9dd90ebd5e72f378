"""deploy/scale/ configs, validated offline by the real tools: vmagent's scrape
config (vmagent -dryRun), the rules as vmalert loads them (vmalert -dryRun,
templates included) and the remote_write alternative (promtool check config)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SCALE = ROOT / "deploy" / "scale"


def run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_vmagent_config_is_valid():
    r = run("vmagent", f"-promscrape.config={SCALE / 'vmagent.yml'}", "-dryRun")
    assert r.returncode == 0, r.stdout + r.stderr


def test_rules_load_in_vmalert(tmp_path):
    r = run(sys.executable, str(SCALE / "vmalert_rules.py"), "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    files = sorted(tmp_path.glob("*.yml"))
    assert [f.name for f in files] == ["alerts.yml", "recording.yml"]
    check = run("vmalert", "-dryRun", *(f"-rule={f}" for f in files))
    assert check.returncode == 0, check.stdout + check.stderr
    # Only keep_firing_for is dropped: the same rules, expressions and for: as the shipped files.
    for f in files:
        shipped = yaml.safe_load((ROOT / "prometheus" / "rules" / f.name).read_text())
        for group in shipped["groups"]:
            for rule in group["rules"]:
                rule.pop("keep_firing_for", None)
        assert yaml.safe_load(f.read_text()) == shipped


def test_remote_write_alternative_is_valid_prometheus_config():
    r = run("promtool", "check", "config", str(SCALE / "prometheus-remote-write.yml"))
    assert r.returncode == 0, r.stdout + r.stderr


def _bucket_derived_records(recording: dict) -> set[str]:
    """Recorded series computed, directly or through other records, from histogram buckets."""
    rules = [r for g in recording["groups"] for r in g["rules"]]
    derived: set[str] = set()
    changed = True
    while changed:
        changed = False
        for r in rules:
            if r["record"] not in derived and ("_bucket" in r["expr"] or any(d in r["expr"] for d in derived)):
                derived.add(r["record"])
                changed = True
    return derived


def test_dropping_per_rank_buckets_keeps_every_alert():
    """docs/scaling.md's large-job mode drops rankscope_*_bucket at scrape time: no alert
    may read a bucket, directly or through a recording rule."""
    recording = yaml.safe_load((ROOT / "prometheus" / "rules" / "recording.yml").read_text())
    alerts = yaml.safe_load((ROOT / "prometheus" / "rules" / "alerts.yml").read_text())
    derived = _bucket_derived_records(recording)
    assert derived == {"run:rankscope_step_duration_seconds:p90"}  # documented in docs/scaling.md
    for rule in (r for g in alerts["groups"] for r in g["rules"]):
        assert "_bucket" not in rule["expr"] and not any(d in rule["expr"] for d in derived), rule["alert"]
    # The relabelling that does it, as shipped (commented) in deploy/scale/vmagent.yml.
    assert 'regex: "rankscope_.+_bucket"' in (SCALE / "vmagent.yml").read_text()
