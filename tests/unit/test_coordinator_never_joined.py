"""A worker that never joins the job (exits, with any code, before saying Hello: e.g. a
TRAIN_CMD that is not a script ending in run_worker) is answered in seconds: in the first
layout the job ends ``failed`` with one line saying what to change; as a joiner of a grow,
its resize ends without pausing the old layout and the job trains on to its end. Real
processes, the real `slurm-etc run`, coordinator, local backend, channel and SQLite record."""
from __future__ import annotations

import logging
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

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

LINE = re.compile(r"vrank \d+ exited with 0 before joining the job: TRAIN_CMD must run a "
                  r"script that ends in run_worker\(trainer\)")


def test_run_whose_command_never_joins_fails_in_seconds_with_one_line(tmp_path):
    # the case: the wrapper's TRAIN_CMD ran a script that trains on its own, exits 0
    cli = [str(Path(sys.executable).with_name("slurm-etc"))]
    t0 = time.monotonic()
    done = subprocess.run([*cli, "run", "--model", "tiny", "--global-batch", "8",
                           "--hardware", "cpu", "--nodes", "2", "--gpus-per-node", "2",
                           "--db", str(tmp_path / "job.db"), "--state-dir",
                           str(tmp_path / "state"), "--", sys.executable, "-c", "pass"],
                          capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                               "OMP_NUM_THREADS": "1"})
    took = time.monotonic() - t0
    assert done.returncode != 0, done.stderr[-2000:]
    assert took < 30, f"took {took:.1f} s"
    assert LINE.search(done.stderr), done.stderr[-2000:]
    assert "job " in done.stderr and "failed" in done.stderr


WORKER = textwrap.dedent("""
    import os, sys, time

    if os.environ["SLURM_ETC_GENERATION"] != "0":
        sys.exit(0)  # a joiner whose script never calls run_worker
    from slurm_etc.protocol.channel import WorkerChannel
    from slurm_etc.protocol.env import LAYOUT
    from slurm_etc.protocol.messages import Exited, Progress, Resize, Stop, parse_layout
    ch = WorkerChannel.from_env()
    ch.join(60.0, pid=os.getpid())
    job, vrank = os.environ["SLURM_ETC_JOB"], int(os.environ["SLURM_ETC_VRANK"])
    layout = parse_layout(os.environ[LAYOUT])
    step = 0
    while True:
        order = ch.wait(0.1)
        if isinstance(order, Resize):  # the old layout was ordered (and would pause)
            with open(sys.argv[1], "a") as f:
                f.write(f"{order.generation}\\n")
        if isinstance(order, Stop):
            sys.exit(0)
        step += 1
        ch.report(Progress(job, 0, vrank, step, 1.0, 1e-3, step * 8, str(layout.config)))
        if step >= 80:
            ch.report(Exited(job, 0, vrank, "done", step))
            time.sleep(0.2)
            sys.exit(0)
""")


def test_joiner_that_never_joins_pauses_nobody_and_the_job_finishes(tmp_path, caplog):
    caplog.set_level(logging.INFO, "slurm_etc")
    worker, orders = tmp_path / "worker.py", tmp_path / "orders.txt"
    worker.write_text(WORKER)
    spec = JobSpec("never-1", "t", (sys.executable, str(worker), str(orders)),
                   TrainingJob(PRESETS["tiny"], 8, 1, False), EffectivePolicy(),
                   DEMO_HARDWARE, worker_timeout_s=60.0, order_after_joined=True)
    # one node trains; at step 3 a second node is granted: its joiner exits 0 at once
    backend = LocalBackend(script_from_options(2, 1, initial_nodes=1,
                                               events=[{"at_step": 3, "grant": ["n1"]}]),
                           log_dir=tmp_path / "workers")
    t0 = time.monotonic()
    out = run_job(spec, backend, backend.topology, db=str(tmp_path / "job.db"),
                  state_dir=str(tmp_path / "state"), secret_dir=tmp_path / "keys",
                  deadline_s=90)
    took = time.monotonic() - t0
    assert out["state"] == "finished", out
    assert took < 60, f"took {took:.1f} s"
    assert not orders.exists(), f"the old layout was ordered: {orders.read_text()}"
    aborted = [r.getMessage() for r in caplog.records
               if "aborted" in r.getMessage() and "before joining the job" in r.getMessage()]
    assert aborted and "vrank 1 exited with 0 before joining the job" in aborted[0], aborted


def test_first_worker_silent_past_the_join_timeout_fails_the_job_in_one_line(tmp_path):
    # a command that hangs without ever joining (waits on something forever)
    spec = JobSpec("silent-1", "t", (sys.executable, "-c", "import time; time.sleep(600)"),
                   TrainingJob(PRESETS["tiny"], 8, 1, False), EffectivePolicy(grow=False),
                   DEMO_HARDWARE, worker_timeout_s=60.0, join_timeout_s=2.0)
    backend = LocalBackend(script_from_options(1, 1), log_dir=tmp_path / "workers")
    t0 = time.monotonic()
    out = run_job(spec, backend, backend.topology, db=str(tmp_path / "job.db"),
                  state_dir=str(tmp_path / "state"), secret_dir=tmp_path / "keys",
                  deadline_s=60)
    took = time.monotonic() - t0
    assert out["state"] == "failed", out
    assert took < 20, f"took {took:.1f} s"
    store = open_store_readonly(tmp_path / "job.db")
    try:
        detail = record.job_detail(store, "silent-1")
    finally:
        store.close()
    assert detail is not None
    reason = detail.job.reason or ""
    assert reason.startswith("vrank 0 did not say hello within 2 s of its launch"), reason
    assert "TRAIN_CMD must run a script that ends in run_worker(trainer)" in reason
    assert "\n" not in reason
