"""Who holds up start-up, paged (issue 45's drills 1 and 2, at the fast settings; the production
timing is the promtool test's, docs/alerting.md's time-to-page table).

Real torchrun jobs (tests/loops/late_rank.py, the Monitor made before init_process_group), a
real Prometheus with the shipped rules rendered with prometheus/fast.yaml, and the shipped
Alertmanager routes delivering to a test webhook:

1. rank 1 of 4 sleeps in its own start-up before init_process_group: the page names rank 1,
   and only rank 1; no RunStalled; the job then trains to the end;
2. one node of two: its launcher ran, the other node's never did: the page counts the 2
   missing ranks of 4 and names the node that reported.
"""

from __future__ import annotations

import subprocess

from tests.helpers.adapter_jobs import PagedJob
from tests.helpers.jobs import free_port
from tests.helpers.paging import render_rules
from tests.helpers.promstack import firing_alerts
from tests.helpers.userjob import UserJob

LATE_S = 40.0


def _pages(paged: PagedJob, run: str) -> set[tuple[str, str]]:
    return {(a["labels"]["alertname"], a["labels"].get("rank", "")) for d in paged.hook.snapshot()
            if d.path == "/page" for a in firing_alerts(d) if a["labels"].get("run") == run}


def test_a_rank_late_to_init_process_group_is_paged_by_name(tmp_path):
    rules = render_rules(tmp_path / "rules", fast=True)
    job = UserJob("late_rank.py", "--late-rank", "1", "--late-s", str(LATE_S), "--steps", "20", nproc=4,
                  tmp_path=tmp_path, name="late-rank")
    with PagedJob(job, rules) as paged:
        delivery = paged.wait_for_page("RankscopeStartupBlocked", "1", timeout=LATE_S + 60)
        page = firing_alerts(delivery, "RankscopeStartupBlocked")[0]
        assert "rank 1" in page["annotations"]["summary"], page
        assert "3 rank(s) of the run wait for it" in page["annotations"]["description"], page
        job.wait(timeout=LATE_S + 120)   # the late rank arrives: the job trains to the end
        paged_now = _pages(paged, job.run_id)
    assert paged_now == {("RankscopeStartupBlocked", "1")}, paged_now   # no other rank, no RunStalled


class OneNodeOfTwo(UserJob):
    """Node 0 of a two-node job whose ranks a launcher starts one by one, each with its environment
    (as srun, mpirun or a pod per rank do; torchrun's agents would wait for each other first and
    start no rank at all): ranks 0 and 1 of 4 start, node 1's ranks 2 and 3 never do."""

    master_port = 0

    def start(self, command: list[str] | None = None) -> "UserJob":
        self.out.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        UserJob.running.add(self)
        self.others: list[subprocess.Popen] = []
        for rank in (0, 1):
            env = {**self.environment(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "4",
                   "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(self.master_port)}
            proc = subprocess.Popen([str(self.python), str(self.script), *self.args], cwd=self.cwd, env=env,
                                    stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
            self.others.append(proc)
        self.proc = self.others[0]
        return self

    def kill(self) -> None:
        for proc in getattr(self, "others", []):
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        super().kill()


def test_ranks_whose_node_never_started_are_counted(tmp_path):
    rules = render_rules(tmp_path / "rules", fast=True)
    job = OneNodeOfTwo("late_rank.py", "--give-up-s", "120", tmp_path=tmp_path, name="half-a-job")
    job.master_port = free_port()
    with PagedJob(job, rules) as paged:
        delivery = paged.hook.wait_for(
            lambda d: d.path == "/page" and firing_alerts(d, "RankscopeStartupRanksMissing"), timeout=120)
        page = firing_alerts(delivery, "RankscopeStartupRanksMissing")[0]
        assert page["labels"]["run"] == job.run_id, page
        assert page["annotations"]["summary"].endswith("2 of its ranks never reported"), page
        assert "2 of its 4 ranks" in page["annotations"]["description"], page
        assert "(2 ranks)" in page["annotations"]["description"], page
        paged_now = _pages(paged, job.run_id)
    assert {name for name, _ in paged_now} == {"RankscopeStartupRanksMissing"}, paged_now
