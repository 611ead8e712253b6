"""The commands the Slurm backend builds, against golden files (pure builders, no cluster).

To accept a deliberate change, rewrite a golden file with ``render(...)`` of its case:
    SLURM_ETC_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_slurm_golden.py
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from slurm_etc.slurm import commands
from slurm_etc.slurm.backend import TaskSpec, member_job_spec, worker_step_spec
from slurm_etc.slurm.model import Command
from slurm_etc.slurm.task import decode_payload

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "slurm" / "golden"
PY = "/opt/venv/bin/python"
RUN = "/shared/runs/job-7"


def render(cmd: Command) -> str:
    """One argument a line; the task wrapper's payload decoded below its (opaque) word."""
    lines, payload = [], None
    for i, arg in enumerate(cmd.argv):
        if i > 0 and cmd.argv[i - 1] == "slurm_etc.slurm.task":
            payload = decode_payload(arg)
            lines.append("<payload>")
        else:
            lines.append(arg)
    text = "\n".join(lines) + "\n"
    if cmd.stdin is not None:
        text += "--- stdin ---\n" + cmd.stdin
    if payload is not None:
        text += "--- payload ---\n" + json.dumps(payload, indent=1, sort_keys=True) + "\n"
    if cmd.cwd is not None:
        text += f"--- cwd ---\n{cmd.cwd}\n"
    return text


CASES = {
    # A member for request "grow-1" (2 nodes of 4 GPUs) in scavenge, USR2 120 s ahead.
    "member_sbatch": lambda: commands.sbatch(member_job_spec(
        anchor_job="1234", key="grow-1", nodes=2, gpus_per_node=4, run_dir=RUN, python=PY)),
    # A site without preempt_send_user_signal: SIGTERM is the notice; QOS, account, time
    # limit, an odd key (percent-encoded in the comment) and extra options.
    "member_sbatch_term_qos": lambda: commands.sbatch(member_job_spec(
        anchor_job="1234", key="gen 3=grow", nodes=1, gpus_per_node=8, run_dir=RUN,
        python=PY, partition=None, qos="preemptible", account="proj42",
        time_limit="04:00:00", notice_signal="SIGTERM", signal_lead_s=300,
        extra=("--constraint=a100",))),
    # Workers of generation 2 on one node of a member: vranks 4 and 5 on GPUs 1 and 0.
    "srun_member_node": lambda: commands.srun(worker_step_spec(
        allocation="1240", node="gpu-a07", python=PY,
        tasks=[TaskSpec(4, 1, {"SLURM_ETC_VRANK": "4", "SLURM_ETC_GENERATION": "2",
                               "SLURM_ETC_DEVICE": "gpu-a07:1"}),
               TaskSpec(5, 0, {"SLURM_ETC_VRANK": "5", "SLURM_ETC_GENERATION": "2",
                               "SLURM_ETC_DEVICE": "gpu-a07:0"})],
        argv=["python", "examples/train_gpt.py", "--steps", "100"])),
    # The same where SIGTERM is the notice: workers ignore it too and stop on SIGINT.
    "srun_member_node_term": lambda: commands.srun(worker_step_spec(
        allocation="1240", node="gpu-a07", python=PY, ignore=("TERM",), stop_signal="INT",
        tasks=[TaskSpec(0, 0, {})], argv=["python", "train.py"])),
    # A container site (pyxis/enroot): the site's and the job's srun options after the
    # step's own, verbatim (slurm/step_options.py).
    "srun_member_node_container": lambda: commands.srun(worker_step_spec(
        allocation="1240", node="gpu-a07", python=PY, tasks=[TaskSpec(0, 0, {})],
        argv=["python", "train.py"],
        options=("--container-image=/shared/images/pytorch-25.11.sqsh",
                 "--container-mounts=/shared:/shared", "--cpu-bind=none", "--mpi=pmix"))),
    "scancel_member": lambda: commands.scancel("1240"),
    "scancel_kill_step": lambda: commands.scancel_signal("1240.3", "KILL"),
    "scontrol_shrink_member": lambda: commands.scontrol_resize("1240", 1, cwd="/tmp/resize"),
    "squeue_members": lambda: commands.squeue(name="etc-1234-member"),
    "squeue_allocations": lambda: commands.squeue(["1234", "1240", "1241"]),
    "sinfo_held_nodes": lambda: commands.sinfo_nodes(["gpu-a07", "gpu-a08"]),
    "scontrol_partition": lambda: commands.scontrol_show_partition("scavenge"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name):
    text = render(CASES[name]())
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("SLURM_ETC_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"{path} differs; see the module docstring"


def test_elastic_sbatch_wrapper():
    """scripts/elastic.sbatch: valid bash, every #SBATCH line where sbatch reads it (before
    the first command), and the anchor's essentials."""
    import subprocess

    path = Path(__file__).resolve().parents[2] / "scripts" / "elastic.sbatch"
    subprocess.run(["bash", "-n", str(path)], check=True)
    lines = path.read_text().splitlines()
    first_command = next(i for i, line in enumerate(lines)
                         if line.strip() and not line.startswith("#"))
    options = [line.split()[1] for line in lines if line.startswith("#SBATCH")]
    assert all(i < first_command for i, line in enumerate(lines) if line.startswith("#SBATCH"))
    assert {"--partition=main", "--exclusive", "--requeue"} <= set(options)
    assert any(o.startswith("--gres=gpu:") for o in options)
    text = path.read_text()
    assert "slurm-etc run --backend slurm" in text and "TRAIN_CMD=" in text
    assert "SLURM_ETC_NOTICE_SIGNAL=${SLURM_ETC_NOTICE_SIGNAL:-USR2}" in text
