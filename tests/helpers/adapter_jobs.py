"""A framework's training job (tests/loops/hf_trainer.py, lightning_trainer.py) watched by the
real paging stack: the job's own node exporter, Debian's Prometheus with the fast rules
scraping it while it runs, the shipped Alertmanager routes, and a webhook receiver.

    with PagedJob(UserJob("hf_trainer.py", ..., nproc=2, tmp_path=tmp), rules) as paged:
        paged.job.wait(...)
        final = paged.final_values()                 # (name, rank, extra label) -> value, after the job
        page = paged.wait_for_page("RankscopeNonFiniteLoss", rank="1")

Prometheus starts before the job with the job's exporter port as its target,
so its first scrapes (about 5 s after its start) come while torch and the
framework are still importing; the job's exporter then stays up after the
job (it keeps a finished run's series) until the job is cleaned up.
"""

from __future__ import annotations

import time
from pathlib import Path

from tests.helpers.paging import alertmanager_config
from tests.helpers.promstack import AlertmanagerServer, Delivery, PrometheusServer, WebhookReceiver, firing_alerts
from tests.helpers.userjob import UserJob

class PagedJob:
    def __init__(self, job: UserJob, rules: list[Path]):
        self.job = job
        self.rules = rules
        self._stack: list = []

    def __enter__(self) -> "PagedJob":
        try:
            self.hook = self._enter(WebhookReceiver())
            self.alertmanager = self._enter(AlertmanagerServer(config_text=alertmanager_config(self.hook)))
            self.prometheus = self._enter(PrometheusServer(targets=[f"127.0.0.1:{self.job.port}"],
                                                           rule_files=self.rules,
                                                           alertmanager=self.alertmanager.address))
            self._enter(self.job)
            self.job.start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _enter(self, thing):
        thing.__enter__()
        self._stack.append(thing)
        return thing

    def __exit__(self, *exc) -> None:
        while self._stack:
            self._stack.pop().__exit__(*exc)

    def final_values(self) -> dict[tuple[str, str, str], float]:
        return final_values(self.job)

    def wait_for_page(self, alertname: str, rank: str, timeout: float = 60.0) -> Delivery:
        def is_page(d: Delivery) -> bool:
            return d.path == "/page" and any(a["labels"].get("rank") == rank
                                             and a["labels"].get("run") == self.job.run_id
                                             for a in firing_alerts(d, alertname))
        return self.hook.wait_for(is_page, timeout=timeout)

    def pages(self, alertname: str) -> list[dict]:
        """Every firing ``alertname`` delivered so far for the job's run."""
        return [a for d in self.hook.snapshot() for a in firing_alerts(d, alertname)
                if a["labels"].get("run") == self.job.run_id]


def final_values(job: UserJob) -> dict[tuple[str, str, str], float]:
    """(metric name, rank, the one extra label's value or "") -> value of the job's run, as its exporter serves them."""
    out = {}
    for s in job.scrape():
        if s.labels.get("run") != job.run_id:
            continue
        extra = [v for k, v in s.labels.items() if k not in ("run", "rank", "local_rank", "node")]
        out[(s.name, s.labels.get("rank", ""), extra[0] if len(extra) == 1 else "")] = s.value
    return out


def wait_until_hang_located(job: UserJob, culprit: str, waiter: str = "0",
                            timeout: float = 180.0) -> dict[tuple[str, str, str], float]:
    """Polls the job's exporter until it names ``culprit`` the hang suspect and ``waiter`` stuck
    in a collective; returns the last values read (the caller's assertions judge them)."""
    deadline = time.monotonic() + timeout
    final: dict[tuple[str, str, str], float] = {}
    while time.monotonic() < deadline and not (
            final.get(("rankscope_hang_suspect", culprit, "")) == 1
            and final.get(("rankscope_rank_state", waiter, "stuck_in_collective")) == 1):
        time.sleep(0.5)
        try:
            final = final_values(job)
        except OSError:   # the exporter is not up yet
            continue
    return final
