"""`slurm-etc simulate --sacct` on a history recorded from the local cluster (issue #44): a
workload script submits GPU jobs, a CPU job, an array and a job cancelled while it runs;
`sacct` (slurmdbd) dumps them with the command docs/simulate-history.md gives, and the
replay reads every one. Run with -s to see the report (docs/results.md keeps one)."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from .test_client import wait_for

pytestmark = pytest.mark.timeout(600)

FORMAT = "JobID,JobName,Partition,State,Submit,Start,End,Elapsed,NNodes,AllocTRES"
CLI = [sys.executable, "-c", "from slurm_etc.cli.main import main; main()"]


def sbatch(*args: str) -> str:
    out = subprocess.run(["sbatch", "--parsable", "-p", "main", "-o", "/dev/null", *args],
                         capture_output=True, text=True, check=True, timeout=60)
    return out.stdout.strip().split(";")[0]


def test_a_recorded_history_replays(client, jobs, tmp_path):
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 5))
    ids = [sbatch("-N1", "--gres=gpu:2", "--wrap", "sleep 4"),
           sbatch("-N1", "--gres=gpu:1", "--wrap", "sleep 2"),
           sbatch("-N1", "--wrap", "sleep 1"),  # a CPU job
           sbatch("-N1", "--gres=gpu:1", "--array=0-1", "--wrap", "sleep 2")]
    cancelled = sbatch("-N1", "--gres=gpu:2", "--wrap", "sleep 300")
    jobs.extend([*ids, cancelled])
    wait_for(lambda: subprocess.run(["squeue", "-h", "-j", cancelled, "-t", "R"],
                                    capture_output=True, text=True).stdout.strip(),
             "the job to cancel running", 60)
    time.sleep(2)
    subprocess.run(["scancel", cancelled], check=True)

    def dumped() -> str | None:
        out = subprocess.run(["sacct", "-a", "-X", "-P", "-S", since, f"--format={FORMAT}",
                              "-j", ",".join([*ids, cancelled])],
                             capture_output=True, text=True, timeout=60)
        lines = out.stdout.strip().splitlines()
        states = [line.split("|")[3] for line in lines[1:]]
        done = len(states) >= 6 and not any(s in ("RUNNING", "PENDING", "COMPLETING")
                                            for s in states)
        return out.stdout if done else None

    history = wait_for(dumped, "sacct to record every job ended", 120, 1.0)
    path = tmp_path / "history.txt"
    path.write_text(history)
    run = subprocess.run([*CLI, "simulate", "--sacct", str(path), "--jobs", "1"],
                         capture_output=True, text=True, timeout=300)
    print(f"$ sacct -a -X -P -S {since} --format={FORMAT}\n{history}\n{run.stdout}")
    assert run.returncode == 0, run.stderr
    out = json.loads(subprocess.run([*CLI, "simulate", "--sacct", str(path), "--jobs", "1",
                                     "--json"], capture_output=True, text=True, timeout=300,
                                    check=True).stdout)
    # two GPU jobs, the array's two elements, the cancelled one (it ran); the CPU job apart
    assert out["jobs"] == 5 and out["cpu_jobs"] == 1, history
    assert 0 < out["gpu_hours_used"] < 1  # seconds of a few GPUs
    assert out["compact"]["rigid_jobs_started"] == 5
    assert "CANCELLED by" in history
