"""The coordinator of a real training job on the local Slurm cluster SIGKILLed mid-training,
after the job grew into a member: the wrapper (scripts/elastic.sbatch, unedited) starts it
again on the same job and record; it finds the member from Slurm, takes up the srun steps
still running from the record (their srun's pid and start time, their stdout file and
stdin FIFO: SlurmBackend.adopt), the workers reattach over the channel and train on from
their step. Nothing is launched again, no step is trained twice, and every loss equals
checkpoint-restart through the same layouts at the same steps (computed here on local
processes, no code shared with the resize).

Oracles: the workers' own step lines in their step logs, the progress lines both
coordinators wrote, ``slurm-etc status --json`` (a process outside the job), the wrapper's
output, and megatron-core's checkpoint-restart losses.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .test_client import running, wait_for, wait_free
from .test_elastic_training import (
    PACE_S,
    VENV_BIN,
    WORKER,
    WRAPPER,
    _progress,
    _running_member,
    _story,
    _world,
)

pytestmark = pytest.mark.timeout(1200)

STEPS = 40


def _coordinator_of(anchor: str) -> int | None:
    """The pid of the anchor's coordinator (`slurm-etc run --backend slurm` in its batch
    script: SLURM_JOB_ID names the anchor)."""
    mark = f"SLURM_JOB_ID={anchor}".encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"slurm-etc") for a in argv) and b"--backend" in argv and \
                mark in environ:
            return int(pid)
    return None


def _worker_steps(log_dir: Path) -> dict[int, list[tuple[int, float, float]]]:
    """Every step line of every worker, from the step logs: vrank -> (step, started, ended),
    in the order logged."""
    out: dict[int, list[tuple[int, float, float]]] = {}
    line = re.compile(r"\[job \S+ gen \d+ vrank (\d+)\] step (\d+) loss .* "
                      r"started ([\d.]+) ended ([\d.]+)")
    for log in sorted(log_dir.glob("*.log")):
        for m in line.finditer(log.read_text(errors="replace")):
            out.setdefault(int(m[1]), []).append((int(m[2]), float(m[3]), float(m[4])))
    return out


def test_coordinator_killed_mid_training_is_restarted_and_reattaches_its_steps(
        client, jobs, tmp_path):
    from slurm_etc.plan import ParallelConfig
    from slurm_etc.plan.model import PRESETS
    from slurm_etc.worker.sequence import ResizeSequence, checkpoint_losses

    wait_free(client, ["n1", "n2", "n3", "n4"])
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}"}
    policy_db = tmp_path / "policy.db"
    subprocess.run(["slurm-etc", "policy", "set", "--partition", "main", "min_nodes=1",
                    "max_nodes=2", "grow=yes", "grow_partition=scavenge"],
                   env={**env, "SLURM_ETC_DB": str(policy_db)}, check=True,
                   capture_output=True, text=True, timeout=60)
    state_dir, run_dir = tmp_path / "state", tmp_path / "run"
    progress, pace = tmp_path / "progress.jsonl", tmp_path / "pace"
    pace.touch()
    job_env = {**env, "OMP_NUM_THREADS": "1", "MODEL": "tiny", "GLOBAL_BATCH": "8",
               "MICRO_BATCH": "1", "HARDWARE": "cpu", "STATE_DIR": str(state_dir),
               "TRAIN_CMD": f"{sys.executable} {WORKER} --train-steps {STEPS} "
                            f"--pace-file {pace} --pace-s {PACE_S}",
               "SLURM_ETC_RUN_DIR": str(run_dir), "SLURM_ETC_MEMBER_PARTITION": "scavenge",
               "SLURM_ETC_RUN_POLICY_DB": str(policy_db),
               "SLURM_ETC_RUN_PROGRESS": str(progress), "SLURM_ETC_RUN_TIMEOUT": "120",
               "SLURM_ETC_RUN_JSON": "1"}
    res = subprocess.run(["sbatch", "--parsable", "--nodelist=n1",
                          f"--output={tmp_path / 'anchor.out'}", str(WRAPPER)],
                         cwd=tmp_path, env=job_env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    anchor = res.stdout.strip().split(";")[0]
    jobs.append(anchor)
    log = tmp_path / "anchor.out"

    def wait(what: str, check, timeout: float = 300):  # type: ignore[no-untyped-def]
        try:
            return wait_for(check, what, timeout, 0.3)
        except BaseException:
            print(_story(log, client))
            raise

    try:
        wait_for(running(client, anchor), "anchor RUNNING")
        first = wait("training in the bigger layout (generation 1)",
                     lambda: next((p for p in _progress(progress) if p["generation"] == 1),
                                  None))
        assert _world(first) == 4, first
        member = _running_member(client, anchor, set())
        assert member is not None, _story(log, client)
        jobs.append(member.job_id)
        wait("a few steps in generation 1",
             lambda: max(p["step"] for p in _progress(progress)) >= first["step"] + 3)
        pid = _coordinator_of(anchor)
        assert pid is not None, _story(log, client)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.time()
        killed_step = max(p["step"] for p in _progress(progress))
        wait("the coordinator started again and reattached",
             lambda: "reattached 4 live worker(s) of generation 1" in log.read_text(), 180)
        wait("training heard by the restarted coordinator",
             lambda: max(p["step"] for p in _progress(progress)) > killed_step + 1, 180)
        pace.unlink()
        wait("the anchor job to end",
             lambda: all(j.state.finished for j in client.jobs([anchor]))
             or not client.jobs([anchor]), 240)
    finally:
        if pace.exists():
            pace.unlink()
        client.cancel(anchor)
    out = log.read_text()
    assert "the coordinator died (exit 137); starting it again" in out, out[-4000:]
    assert '"state": "finished"' in out, _story(log, client)
    assert out.count("[slurm] adopted vranks") == 2, _story(log, client)  # anchor + member

    res = subprocess.run(["slurm-etc", "status", anchor, "--json", "--state-dir",
                          str(state_dir)], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    (job,) = json.loads(res.stdout)["jobs"]
    assert job["state"] == "finished", job
    gens = sorted(job["generations"], key=lambda g: g["number"])
    assert [g["world_size"] for g in gens] == [2, 4], gens  # no generation opened again
    kinds = [e["kind"] for e in job["events"]]
    # two launched in the anchor, two joiners in the member: none launched again
    assert kinds.count("launch") == 4 and kinds.count("reattach") == 1, kinds

    # every worker trained each of its steps once, across the kill: the two of generation 0
    # from step 1, the two that joined from the step after generation 0's last, all to the end
    steps = _worker_steps(run_dir / "logs")
    grow_step = gens[0]["last_step"] + 1
    assert sorted(steps) == [0, 1, 2, 3], sorted(steps)
    for vrank, lines in steps.items():
        start = 1 if vrank in (0, 1) else grow_step
        seen = [n for n, _s, _e in lines]
        assert seen == list(range(start, STEPS + 1)), (vrank, grow_step, seen)
    # what the restart cost the training: the widest gap between two steps of a worker
    gap, after = max((b[1] - a[2], a[0]) for lines in steps.values()
                     for a, b in zip(lines, lines[1:]))
    reattached = next(p["t"] for p in _progress(progress) if p["step"] > killed_step)
    print(f"\nSIGKILL at step {killed_step}: training heard again {reattached - killed_at:.1f} s"
          f" later; widest gap between two steps of a worker {gap:.1f} s (after step {after})")

    # the progress lines: nothing heard twice, at most the steps in the killed socket unheard,
    # every loss checkpoint-restart's
    heard = _progress(progress)
    assert len({p["step"] for p in heard}) == len(heard), "a step heard twice"
    assert len(heard) >= STEPS - 2 and max(p["step"] for p in heard) == STEPS
    ends = tuple(g["last_step"] for g in gens)
    seq = ResizeSequence(PRESETS["tiny"],
                         tuple(ParallelConfig.parse(g["layout"]) for g in gens),
                         steps=1, global_batch=8, ends=ends, total_steps=STEPS)
    reference = checkpoint_losses(seq)
    assert {p["step"]: p["loss"] for p in heard} == \
        {p["step"]: reference[p["step"]]["loss"] for p in heard}
    wait_for(lambda: not [j for j in client.jobs() if j.job_id == member.job_id
                          and not j.state.finished], "the member to end", 60)
    assert not list((run_dir / "steps").glob("*.in")), "a step's FIFO left behind"
