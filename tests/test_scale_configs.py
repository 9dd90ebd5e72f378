"""deploy/scale/ configs, validated offline by the real tools: vmagent's scrape
config (vmagent -dryRun), the rules as vmalert loads them (vmalert -dryRun,
templates included) and the remote_write alternative (promtool check config)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
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
