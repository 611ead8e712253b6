"""Capture real Slurm output for the parser tests (tests/unit/test_slurm_parsers.py).

Run against an idle local cluster (scripts/slurm-local.sh up; export SLURM_CONF=...):

    .venv/bin/python tests/slurm/make_fixtures.py

It builds a scene — jobs running, pending, held, finished, a scavenge member in its
preemption grace, then requeued; a node DOWN and a node draining — and writes each
command's output, exactly as printed, to tests/fixtures/slurm/<slurm version>/, with
commands.txt listing what produced each file. It takes about a minute (the preemption
grace), then cancels its jobs and resumes its nodes. Run it on a Debian 13 machine to add
24.11 fixtures beside the 22.05 ones.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from slurm_etc.slurm import BatchSpec, CliSlurmClient, NodeAdminState, SlurmJobState, commands
from slurm_etc.slurm.model import Command

ROOT = Path(__file__).resolve().parents[2]


def version() -> str:
    out = subprocess.run(["sinfo", "--version"], capture_output=True, text=True).stdout
    return out.split()[-1]


class Capture:
    def __init__(self, outdir: Path):
        self.outdir = outdir
        self.outdir.mkdir(parents=True, exist_ok=True)
        self.index: list[str] = []

    def __call__(self, name: str, cmd: Command, *, check: bool = True) -> str:
        res = subprocess.run(cmd.argv, input=cmd.stdin, capture_output=True, text=True)
        if check and res.returncode != 0:
            sys.exit(f"{cmd} failed: {res.stderr}")
        (self.outdir / f"{name}.out").write_text(res.stdout)
        if res.stderr or res.returncode:
            (self.outdir / f"{name}.err").write_text(res.stderr)
        self.index.append(f"{name}: exit {res.returncode}: {cmd}")
        return res.stdout

    def close(self) -> None:
        (self.outdir / "commands.txt").write_text("\n".join(self.index) + "\n")


def wait(predicate, what: str, timeout: float = 120.0, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    sys.exit(f"timed out waiting for {what}")


def main() -> None:
    client = CliSlurmClient()
    if any(n.state.value != "idle" for n in client.nodes()) or client.jobs():
        sys.exit("needs an idle cluster with no jobs")
    cap = Capture(ROOT / "tests" / "fixtures" / "slurm" / version())
    sleeper = "#!/bin/sh\nsleep 600\n"
    out = "/tmp/slurm-etc-fixtures-%j.out"
    jobs = []
    try:
        done = cap("sbatch_parsable", commands.sbatch(BatchSpec(
            script="#!/bin/sh\ntrue\n", name="done", output=out))).strip()
        jobs.append(done)
        anchor = client.submit(BatchSpec(script=sleeper, name="anchor", nodes=2, gpus_per_node=2,
                                       signal="USR2@60", output=out, nodelist=("n1", "n2")))
        # The member's batch shell must survive its USR2 (sh dies of an untrapped USR2).
        member = client.submit(BatchSpec(script="#!/bin/sh\ntrap '' USR2\nsleep 600\n",
                                       name="member", partition="scavenge", nodes=1,
                                       exclusive=True, nodelist=("n4",),
                                       signal="USR2@60", signal_batch_only=True, output=out))
        wide = client.submit(BatchSpec(script=sleeper, name="wide", nodes=4, exclusive=True,
                                     output=out))
        held = client.submit(BatchSpec(script=sleeper, hold=True, output=out,
                                     extra=("--job-name=odd name|with pipe",)))
        jobs += [anchor, member, wide, held]
        wait(lambda: all(j.state == SlurmJobState.RUNNING for j in client.jobs([anchor, member])),
             "anchor and member running")
        time.sleep(2)  # let the member's shell set its trap before it is preempted
        cap("squeue_running", commands.squeue(jobs))
        cap("scontrol_job_running", commands.scontrol_show_job(anchor))
        cap("scontrol_job_pending", commands.scontrol_show_job(wide))
        cap("scontrol_job_held", commands.scontrol_show_job(held))
        cap("scontrol_job_completed", commands.scontrol_show_job(done))
        cap("squeue_unknown", commands.squeue(["999999"]), check=False)
        cap("scontrol_job_unknown", commands.scontrol_show_job("999999"), check=False)

        high = client.submit(BatchSpec(script=sleeper, name="preemptor", partition="high",
                                     nodes=1, exclusive=True, nodelist=("n4",), output=out))
        jobs.append(high)
        wait(lambda: client.job(member).preempt_time, "member picked for preemption")
        cap("squeue_grace", commands.squeue(jobs))
        cap("scontrol_job_grace", commands.scontrol_show_job(member))

        client.set_node_state(["n3"], NodeAdminState.DOWN, "fixture: node lost")
        client.set_node_state(["n2"], NodeAdminState.DRAIN, "fixture: maintenance window")
        cap("sinfo_down_drain", commands.sinfo_nodes())
        cap("sinfo_one_node", commands.sinfo_nodes(["n3"]))

        wait(lambda: client.job(member).restarts, "member requeued", timeout=150)
        cap("squeue_requeued", commands.squeue(jobs))
        cap("scontrol_job_requeued", commands.scontrol_show_job(member))
        cap("scontrol_jobs_all", commands.scontrol_show_job())
        cap("scontrol_partition_scavenge", commands.scontrol_show_partition("scavenge"))
        cap("scontrol_partition_unknown", commands.scontrol_show_partition("nosuch"),
            check=False)
    finally:
        for job in jobs:
            subprocess.run(["scancel", job])
        client.set_node_state(["n2", "n3"], NodeAdminState.RESUME)
        # Just resumed nodes show as not responding (idle*) until slurmd's next ping; the
        # requeued, then cancelled member can leave its node "planned" for a while.
        cap("sinfo_after_resume", commands.sinfo_nodes())
        cap.close()
    print(f"wrote {cap.outdir}")


if __name__ == "__main__":
    main()
