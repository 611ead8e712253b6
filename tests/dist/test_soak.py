"""``slurm-etc soak`` on a real job, briefly: a fixed seed's few events (two grants, a second
coordinator refused, two nodes lost; see SEED) through ``slurm-etc run`` on the
local backend with real ``tiny`` workers, every check passing; then each check shown to
catch its planted bug in that real soak's observations (slurm_etc/testing/soak_plants.py):
a step trained twice, a loss one ulp off, a migration left open, a process left behind.

The long soak (hundreds of events over seeds) is in docs/results.md with its command.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import replace

import pytest

from slurm_etc.harness.soak import MARK, check, job_processes, observe, oracle_losses
from slurm_etc.harness.soak_schedule import draw_schedule
from slurm_etc.testing import soak_plants as plant

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

# one seed, about 1.5 min on 2 cores; its kinds (root or not: neither draws a full disk).
# Seed 6 (a worker killed, then a second one during the resize around it) is not here:
# it finds a bug of the product (docs/results.md, "A seeded soak").
SEED, EVENTS = 2, 5
KINDS = ["grant", "grant", "duplicate", "lose", "lose"]


def test_a_short_soak_passes_and_every_check_catches_its_plant(tmp_path):
    schedule = draw_schedule(SEED, EVENTS, full_disk=os.geteuid() == 0)
    assert [e.kind for e in schedule.events] == KINDS
    seen = observe(SEED, EVENTS, work=tmp_path / "soak")
    assert seen.schedule == schedule  # the seed's schedule, as drawn without running
    oracle, layouts = oracle_losses(seen.record, say=print)
    report = check(seen, oracle, layouts)
    print({k: v for k, v in report.items() if k != "schedule"})
    assert report["ok"], report
    assert report["diverged_steps"] == 0 and report["leaked_processes"] == 0
    assert report["record_consistent"] and report["job_state"] == "finished"
    assert report["resizes_committed"] >= 1 and report["steps"] > 10
    assert report["duplicates_refused"] == 1
    assert len(oracle) >= report["steps"] - report["unheard_steps"]

    # each check catches its plant in this soak's own observations
    twice = check(replace(seen, record=plant.step_twice(seen.record)), oracle, layouts)
    assert not twice["ok"] and twice["steps_twice"], twice["steps_twice"]
    ulp = check(replace(seen, heard=plant.loss_off_by_one_ulp(seen.heard)), oracle, layouts)
    assert not ulp["ok"] and ulp["diverged_steps"] == 1, ulp["diverged"]
    open_ = check(replace(seen, record=plant.migration_left_open(seen.record)), oracle,
                  layouts)
    assert not open_["ok"] and not open_["record_consistent"], open_["record_problems"]
    job = "soak-plant-" + str(os.getpid())
    left = plant.leftover_process(job, MARK)
    try:
        deadline = time.monotonic() + 10
        while left.pid not in job_processes(job):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        leaked = check(replace(seen, leaked=job_processes(job)), oracle, layouts)
        assert not leaked["ok"] and leaked["leaked_processes"] == 1, leaked["leaked_pids"]
    finally:
        os.killpg(left.pid, signal.SIGKILL)
        left.wait()
