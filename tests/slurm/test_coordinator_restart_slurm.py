"""The coordinator of a Slurm job SIGKILLed right after it submitted a member allocation
(``SLURM_ETC_COORDINATOR_INJECT=after-request``) while that member is PENDING (a job in
``main`` holds the other nodes), then started again on the same job, anchor and database:
the open request is sent again under its own key and the backend, which found the member
by its comment, submits nothing; the member runs once the nodes are free, the job grows
into it and finishes.

Oracles, sharing no code with the coordinator: Slurm's own accounting (``sacct``: every
member job ever submitted for this anchor), ``squeue`` while the member is pending, the
backend's log of every request and release (tests/slurm/restart_slurm_driver.py) and the
record read with plain sqlite3 (the restart tests' ``problems``)."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_etc.slurm import BatchSpec, SlurmJobState
from slurm_etc.slurm.backend import member_job_name
from slurm_etc.testing.hooks import COORDINATOR_INJECT
from tests.dist.test_coordinator_restart import _kill_orphans, problems

from .test_client import running, wait_for, wait_free

pytestmark = pytest.mark.timeout(900)

DRIVER = Path(__file__).with_name("restart_slurm_driver.py")


def _driver(tmp: Path, job: str, anchor: str, inject: str | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != COORDINATOR_INJECT}
    if inject:
        env[COORDINATOR_INJECT] = inject
    return subprocess.Popen([sys.executable, str(DRIVER), str(tmp), job, anchor], env=env,
                            stdout=subprocess.PIPE, stderr=open(tmp / f"driver-{inject}.log",
                                                                 "w"), text=True)


def _sacct_members(anchor: str) -> list[tuple[str, str]]:
    out = subprocess.run(["sacct", "-n", "-X", "-P", f"--name={member_job_name(anchor)}",
                          "-o", "JobID,State"], capture_output=True, text=True, check=True)
    return [tuple(line.split("|")[:2]) for line in out.stdout.splitlines() if line.strip()]


def _cancel_steps(anchor: str) -> None:
    """The killed coordinator's srun steps in the anchor (their workers are orphans)."""
    out = subprocess.run(["squeue", "-h", "-s", "-j", anchor, "-o", "%i"],
                         capture_output=True, text=True).stdout.split()
    for step in out:
        if step.startswith(f"{anchor}.") and not step.endswith((".batch", ".extern")):
            subprocess.run(["scancel", step], capture_output=True)


def test_killed_after_request_while_member_pending(client, jobs, tmp_path: Path) -> None:
    wait_free(client, ["n1", "n2", "n3", "n4"])
    anchor = client.submit(BatchSpec(script="#!/bin/sh\nsleep 900\n", name="anchor",
                                   partition="main", nodes=1, gpus_per_node=2, exclusive=True,
                                   nodelist=("n1",), output=str(tmp_path / "anchor-%j.out")))
    jobs.append(anchor)
    blocker = client.submit(BatchSpec(script="#!/bin/sh\nsleep 900\n", name="blocker",
                                    partition="main", nodes=3, exclusive=True,
                                    nodelist=("n2", "n3", "n4"),
                                    output=str(tmp_path / "blocker-%j.out")))
    jobs.append(blocker)
    wait_for(running(client, anchor), "anchor RUNNING")
    wait_for(running(client, blocker), "blocker RUNNING")
    job = f"slurm-restart-{os.getpid()}"

    first = _driver(tmp_path, job, anchor, "after-request")
    try:
        first.wait(300)
    finally:
        if first.poll() is None:
            first.kill()
    log = (tmp_path / "driver-after-request.log").read_text()
    assert first.returncode == -signal.SIGKILL, log[-3000:]
    assert f"{COORDINATOR_INJECT}=after-request" in log
    members = client.jobs(name=member_job_name(anchor))
    jobs.extend(m.job_id for m in members)
    assert [m.state for m in members] == [SlurmJobState.PENDING], members
    member = members[0].job_id
    _cancel_steps(anchor)
    _kill_orphans(job)

    second = _driver(tmp_path, job, anchor, None)
    try:
        # restarted, the member still pending: nothing more is submitted meanwhile
        t_end = time.monotonic() + 10
        while time.monotonic() < t_end:
            now = client.jobs(name=member_job_name(anchor))
            assert [m.job_id for m in now] == [member], now
            assert second.poll() is None
            time.sleep(0.5)
        subprocess.run(["scancel", blocker], check=True)  # the nodes free up: it runs
        out, _ = second.communicate(timeout=600)
    finally:
        if second.poll() is None:
            second.kill()
    log2 = (tmp_path / "driver-None.log").read_text()
    assert second.returncode == 0, log2[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["state"] == "finished"

    # Slurm: one member job ever for this anchor (the one submitted before the kill)
    assert [jid for jid, _state in _sacct_members(anchor)] == [member]
    actions = [json.loads(line) for line in
               (tmp_path / "actions.jsonl").read_text().splitlines()]
    requests = [a for a in actions if "request" in a]
    runs = list(dict.fromkeys(a["run"] for a in actions))
    # the killed run submitted it; the restarted one sent the open request again under its
    # key and the backend, which had found the member, submitted nothing
    assert [(a["request"], a["submitted"]) for a in requests] == [
        ("grow-1", member), ("grow-1", None)], requests
    assert [a["run"] for a in requests] == runs[:2]
    assert problems(tmp_path / "job.db", actions) == []
    con = sqlite3.connect(f"file:{tmp_path / 'job.db'}?mode=ro", uri=True)
    try:
        grown = con.execute("SELECT count(*) FROM generations WHERE world_size = 4"
                            ).fetchone()[0]
        member_grants = con.execute(
            "SELECT count(*) FROM events WHERE kind = 'grant' AND "
            "json_extract(payload, '$.allocation') = ?", (member,)).fetchone()[0]
    finally:
        con.close()
    assert grown == 1 and member_grants == 1  # the job went on: it grew into the member once
    done = wait_for(lambda: all(j.state is not SlurmJobState.RUNNING
                                for j in client.jobs([member])), "member ended", 60)
    assert done
