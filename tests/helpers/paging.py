"""What a run delivers to the pager: the shipped Alertmanager config pointed at a
test webhook, the deliveries of one run, and the noisy healthy run that must
deliver nothing.

Used by the fault matrix (tests/drills/test_fault_matrix.py: every fault, and the
10-minute healthy run at the production thresholds) and by the regular suite's
2-minute healthy run at the fast thresholds (tests/drills/test_healthy_run.py).
"""

from __future__ import annotations

import copy
import json
import shutil
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import yaml

from prometheus import generate
from tests.helpers.jobs import TrainJob, free_port
from tests.helpers.promstack import AlertmanagerServer, PrometheusServer, WebhookReceiver, firing_alerts

ROOT = Path(__file__).resolve().parents[2]
ALERTMANAGER_YML = ROOT / "prometheus" / "alertmanager.yml"
FAST_OVERRIDE = ROOT / "prometheus" / "fast.yaml"

STEP_DELAY = "0.05"        # ~20 steps/s on every rank: steady and cheap
START_TIMEOUT = 180.0      # job start to its first steps (torch starts slowly on a loaded 2-core machine)


def alertmanager_config(hook: WebhookReceiver) -> str:
    """The shipped alertmanager.yml with the webhooks pointed at the test receiver and the
    grouping delays cut to a second (the fast rules evaluate every second). Shorter
    grouping only makes a delivery likelier, so a quiet run here is quiet in production."""
    config = copy.deepcopy(yaml.safe_load(ALERTMANAGER_YML.read_text()))
    config["route"].update(group_wait="1s", group_interval="1s")
    for route in config["route"].get("routes", []):
        route["group_wait"] = "1s"
        if "group_interval" in route:
            route["group_interval"] = "1s"
    for receiver in config["receivers"]:
        for webhook in receiver.get("webhook_configs", []):
            webhook["url"] = hook.url(urlparse(webhook["url"]).path)
    return yaml.safe_dump(config, sort_keys=False)


def render_rules(out: Path, *, fast: bool) -> list[Path]:
    """The shipped rules, rendered with the fast drill thresholds or the production ones."""
    generate.main([*(["--override", str(FAST_OVERRIDE)] if fast else []), "--out", str(out)])
    return [out / generate.RECORDING_FILE, out / generate.ALERTS_FILE]


def run_deliveries(hook: WebhookReceiver, run: str) -> list[tuple[str, str, str]]:
    """Every (receiver path, alertname, rank) delivered firing for ``run``, in order, once each."""
    seen = []
    for d in hook.snapshot():
        for a in firing_alerts(d):
            if a["labels"].get("run") == run:
                key = (d.path, a["labels"]["alertname"], a["labels"].get("rank", ""))
                if key not in seen:
                    seen.append(key)
    return seen


@dataclass(frozen=True)
class Noise:
    """What a healthy run does that a naive rule mistakes for a fault."""
    jitter: float = 0.2              # step time x U(1 - jitter, 1 + jitter)
    loss_noise: float = 0.05
    eval_every: int = 400            # steps (20 steps/s: every 20 s)
    eval_pause_s: float = 2.0
    checkpoint_every: int = 1000
    checkpoint_pause_s: float = 4.0
    # Rank 0 saves inside monitor.checkpoint() while the other ranks wait for it in a barrier,
    # outside any block: what a hang looks like, but for the block.
    save_on_rank0_only: bool = True
    job: tuple[str, ...] = ()        # the trainer's own arguments (its data, its learning rate)

    def args(self) -> list[str]:
        return ["--jitter", str(self.jitter), "--loss-noise", str(self.loss_noise),
                "--eval-every", str(self.eval_every), "--eval-pause", str(self.eval_pause_s),
                "--checkpoint-every", str(self.checkpoint_every),
                "--checkpoint-pause", str(self.checkpoint_pause_s),
                *(["--save-on-rank0-only"] if self.save_on_rank0_only else []), *self.job]


# The 2-minute run at the fast thresholds: pauses scaled to the fast rules' windows.
FAST_NOISE = Noise(checkpoint_pause_s=8.0)   # past the fast hang bars (3 s + 2 s): only the block keeps it quiet
# The 10-minute run at the production thresholds, as the alerting docs describe a
# healthy job: an evaluation every 2 minutes, a 20-second checkpoint.
PRODUCTION_NOISE = Noise(eval_every=2400, eval_pause_s=10.0, checkpoint_every=3000, checkpoint_pause_s=20.0)
# The 30-minute soak at the production thresholds (bash tests/run.sh --soak): a 2-minute
# checkpoint (rank 0 saves, the other rank waits in a barrier: far past every hang bar) and a
# 3-minute evaluation (past RunStalled's 180 s), each more than once, a restart between. A job
# that learns for 30 minutes: on the default 32k samples at lr 0.05 the reference model memorises,
# then its training loss climbs back (0.18 to 0.99 over 32k steps, eval accuracy at chance) with
# z > 6 jumps that LossSpikes rightly warns of; on 262k samples at lr 0.01 it learns (eval
# accuracy 0.54 to 0.80) with no spike in 32k steps.
SOAK_NOISE = Noise(eval_every=12000, eval_pause_s=180.0, checkpoint_every=8000, checkpoint_pause_s=120.0,
                   job=("--samples", "262144", "--lr", "0.01"))


@dataclass
class HealthyOutcome:
    run: str
    seconds: float
    delivered: list[tuple[str, str, str]] = field(default_factory=list)
    prometheus_firing: list[dict] = field(default_factory=list)
    first_launch_steps: int = 0
    resumed_from_step: int = 0
    final_steps: dict[str, float] = field(default_factory=dict)   # rank -> step, just before the end
    evidence: list[str] = field(default_factory=list)   # captures the exporter kept: none in a healthy run
    error: str | None = None

    def describe(self) -> str:
        return (f"{self.error or ''}\ndelivered for {self.run}: {self.delivered}\nfiring: {self.prometheus_firing}\n"
                f"evidence captured: {self.evidence}\n"
                f"steps: {self.first_launch_steps} in the first launch, resumed from {self.resumed_from_step}, "
                f"then reached {self.final_steps}")

    def trained_through_the_restart(self) -> bool:
        """Both launches really trained: the second resumed from the checkpoint and went on."""
        return len(self.final_steps) == 2 and min(self.final_steps.values()) > self.resumed_from_step


def _what_triggered(capture: Path) -> str:
    """A capture's trigger, state and time, for the failure message (the files go with the run)."""
    try:
        doc = json.loads(capture.read_text())
        return f"trigger {doc.get('trigger')}, state {doc.get('state')}, at {doc.get('captured_at')}"
    except (OSError, ValueError):
        return "unreadable"


def run_healthy(rules: list[Path], am: AlertmanagerServer, hook: WebhookReceiver, work: Path,
                seconds: float, noise: Noise = FAST_NOISE, scrape_interval: str = "1s") -> HealthyOutcome:
    """A noisy healthy run, stopped cleanly at a checkpoint and restarted from it as a
    rescheduled job is, for ``seconds`` in all. Nothing may be delivered."""
    run = f"healthy-{uuid.uuid4().hex[:6]}"
    out = HealthyOutcome(run, seconds)
    port, metrics, ckpt = free_port(), work / run / "m", work / run / "ckpt"
    metrics.parent.mkdir(parents=True, exist_ok=True)
    # The first launch ends a while after its first checkpoint, so that the restart
    # repeats the steps since then, as a rescheduled job does.
    first_steps = noise.checkpoint_every + int(seconds * 20 * 0.2)
    out.first_launch_steps, out.resumed_from_step = first_steps, first_steps // noise.checkpoint_every * noise.checkpoint_every
    try:
        args = [*noise.args(), "--step-delay", STEP_DELAY, "--checkpoint-dir", str(ckpt)]
        first = TrainJob(nproc=2, steps=first_steps, run_id=run, port=port, metrics_dir=metrics, extra_args=args)
        with first, PrometheusServer(targets=[f"127.0.0.1:{port}"], rule_files=rules, alertmanager=am.address,
                                     scrape_interval=scrape_interval, evaluation_interval=scrape_interval) as prom:
            deadline = time.monotonic() + seconds
            assert first.wait(timeout=seconds + START_TIMEOUT) == 0, first.log()[-2000:]
            remaining = max(deadline - time.monotonic(), 30.0)
            second = TrainJob(nproc=2, steps=10**6, run_id=run, port=port, metrics_dir=metrics,
                              extra_args=[*args, "--resume"])
            with second:
                time.sleep(remaining)
                out.delivered = run_deliveries(hook, run)
                out.prometheus_firing = [a["labels"] for a in prom.alerts() if a["state"] == "firing"]
                out.final_steps = {x.labels["rank"]: x.value for x in second.scrape() if x.name == "rankscope_step"}
    except Exception:  # noqa: BLE001 - reported by the test
        out.error = traceback.format_exc()
    finally:
        out.evidence = sorted(f"{p.relative_to(metrics)} ({_what_triggered(p)})"
                              for p in metrics.glob("*/evidence/rank-*.json"))
        shutil.rmtree(work / run, ignore_errors=True)
    return out
