"""A job whose workers all died, with nothing pending (no resize, no request, no event),
ends ``failed`` with one line within seconds (before: it waited with 0 devices forever; on
Slurm it would hold the anchor until its time limit). The real coordinator, local backend
and SQLite record; the workers are processes that exit at once."""
from __future__ import annotations

import sys
import time

from slurm_etc.alloc.chooser import TrainingJob
from slurm_etc.coordinator.job import JobSpec
from slurm_etc.coordinator.run import run_job
from slurm_etc.local.backend import LocalBackend
from slurm_etc.local.demo import DEMO_HARDWARE
from slurm_etc.local.script import script_from_options
from slurm_etc.plan.model import PRESETS
from slurm_etc.policy.rules import EffectivePolicy
from slurm_etc.store import jobs as record
from slurm_etc.store.db import open_store_readonly


def test_all_workers_dead_and_nothing_pending_fails_the_job(tmp_path):
    # four workers (dp=2 x tp=2 on two nodes) that exit together, as when junk in the
    # rendezvous made every worker fail: the resize that loses them all aborts, and no
    # layout fits the 0 devices left
    die = "import sys, time; time.sleep(3 - time.time() % 3 + 1); sys.exit(3)"
    spec = JobSpec("dead-1", "t", (sys.executable, "-c", die),
                   TrainingJob(PRESETS["tiny"], 8, 1, False), EffectivePolicy(grow=False),
                   DEMO_HARDWARE, worker_timeout_s=60.0)
    backend = LocalBackend(script_from_options(2, 2, initial_nodes=2),
                           log_dir=tmp_path / "workers")
    t0 = time.monotonic()
    out = run_job(spec, backend, backend.topology, db=str(tmp_path / "job.db"),
                  state_dir=str(tmp_path / "state"), secret_dir=tmp_path / "keys",
                  deadline_s=90)
    took = time.monotonic() - t0
    assert out["state"] == "failed", out
    assert took < 30, f"ended after {took:.1f} s"
    store = open_store_readonly(tmp_path / "job.db")
    try:
        detail = record.job_detail(store, "dead-1")
    finally:
        store.close()
    assert detail is not None and detail.job.state == "failed"
    reason = detail.job.reason or ""
    assert "\n" not in reason and "no end within" not in reason, reason
