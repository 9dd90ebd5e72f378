"""Issue 30: long steps are not hangs. A job whose steps take 5 s, with the exporter's floor
cut to 2 s (`RANKSCOPE_STUCK_AFTER_S`): scaled down from 45 s steps and the 30 s default,
the ratio that made every rank of such a job read `stuck` in a third of all scrapes. The
exporter judges each rank by its own recent steps (`--stuck-after-steps`, 3), so the job never
reads stuck between steps; when it really hangs, it is stuck, and its culprit the suspect,
within three of its steps."""

from __future__ import annotations

import time

from tests.helpers.jobs import TrainJob, wait_until

STEP_S = 5.0
HANG_AT = 6


def test_a_job_with_long_steps_never_reads_stuck_and_its_hang_is_found_within_three_steps():
    env = {"RANKSCOPE_STUCK_AFTER_S": "2", "RANKSCOPE_SUSPECT_AFTER_S": "2"}
    with TrainJob(nproc=2, steps=100, env=env, extra_args=["--step-delay", str(STEP_S), "--hang-at", str(HANG_AT),
                                                           "--fault-rank", "1"]) as job:
        wait_until(lambda: job.health(), 180, what="the exporter")

        def states():
            samples = job.scrape()
            on = {s.labels["rank"]: s.labels["state"] for s in samples if s.name == "rankscope_rank_state" and s.value}
            suspects = {s.labels["rank"] for s in samples if s.name == "rankscope_hang_suspect" and s.value}
            steps = {s.labels["rank"]: s.value for s in samples if s.name == "rankscope_step"}
            return on, suspects, steps

        wait_until(lambda: min(states()[2].values() or [0]) >= 1, 180, what="the first steps")
        seen: list[tuple[dict, set]] = []
        while min(states()[2].values()) < HANG_AT - 1:   # five long steps, scraped twice a second
            on, suspects, _ = states()
            seen.append((on, suspects))
            time.sleep(0.5)
        assert len(seen) > 30
        assert all(set(on.values()) <= {"progressing"} and not suspects for on, suspects in seen), seen
        hung_from = time.monotonic()
        wait_until(lambda: (lambda on, suspects, _: on.get("1") == "stuck" and suspects == {"1"}
                            and on.get("0") == "stuck_in_collective")(*states()),
                   6 * STEP_S, what="rank 1 stuck and the suspect, rank 0 stuck in its collective")
        found_s = time.monotonic() - hung_from
        print(f"hang found {found_s:.1f} s after the last step ({STEP_S:.0f} s steps)")
        assert found_s < 4 * STEP_S + 5
