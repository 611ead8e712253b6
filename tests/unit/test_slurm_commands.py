"""Command builders, state tables, the runner's errors: pure or local, no cluster."""
import sys
from pathlib import Path

import pytest

from slurm_etc.slurm import (
    BatchSpec,
    CliSlurmClient,
    Command,
    NodeAdminState,
    NodeState,
    SlurmClient,
    SlurmError,
    SlurmJobState,
    SlurmRunner,
    SlurmSpecError,
    StepSpec,
    commands,
)
from slurm_etc.slurm.model import SLURM_JOB_STATES, job_state, node_state

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "slurm" / "golden"

FULL_SPEC = BatchSpec(
    script="#!/bin/bash\nexec python -m slurm_etc.worker\n",
    name="etc-member", partition="scavenge", account="proj", qos="low", nodes=2,
    ntasks_per_node=2, cpus_per_task=1, gpus_per_node=2, exclusive=True,
    nodelist=("n3", "n4"), exclude=("n1",), time_limit="01:00:00", signal="USR2@60",
    signal_batch_only=True, requeue=True, output="/tmp/%j.out", error="/tmp/%j.err",
    workdir="/tmp", dependency="after:12", hold=False, extra=("--comment=slurm-etc",),
)


def render(cmd: Command) -> str:
    return "\n".join(cmd.argv) + "\n--- stdin ---\n" + (cmd.stdin or "")


def test_sbatch_golden():
    # To accept a deliberate change: rewrite the file with render(commands.sbatch(FULL_SPEC)).
    assert render(commands.sbatch(FULL_SPEC)) == (GOLDEN / "sbatch_full.txt").read_text()


def test_sbatch_minimal():
    cmd = commands.sbatch(BatchSpec(script="#!/bin/sh\ntrue\n"))
    assert cmd.argv == ("sbatch", "--parsable") and cmd.stdin == "#!/bin/sh\ntrue\n"
    cmd = commands.sbatch(BatchSpec(script="#!/bin/sh\n", signal="USR2@60", requeue=False))
    assert cmd.argv[2:] == ("--signal=USR2@60", "--no-requeue")


@pytest.mark.parametrize("kwargs,message", [
    ({"script": "sleep 1"}, "#! line"),
    ({"nodes": 0}, r"nodes \(0\) must be at least 1"),
    ({"gpus_per_node": -1}, "gpus_per_node"),
    ({"signal": "USR2@soon"}, "whole seconds"),
    ({"signal": "US R2"}, "not a signal name"),
    ({"signal_batch_only": True}, "needs signal"),
    ({"name": "a b"}, "job name"),
    ({"nodelist": "n1,n2"}, "sequences of node names"),
])
def test_job_spec_errors(kwargs, message):
    spec = {"script": "#!/bin/sh\n", **kwargs}
    with pytest.raises(SlurmSpecError, match=message):
        BatchSpec(**spec)


def test_srun():
    step = StepSpec(job_id="12", argv=["python", "-m", "w", "--gen", "3"], nodes=1, ntasks=2,
                    nodelist=("n4",), gpus_per_task=1, overlap=True, label=True,
                    signal="SIGUSR2@30", kill_on_bad_exit=True)
    assert commands.srun(step).argv == (
        "srun", "--jobid=12", "--nodes=1", "--ntasks=2", "--nodelist=n4", "--gpus-per-task=1",
        "--overlap", "--label", "--kill-on-bad-exit=1", "--signal=USR2@30",
        "python", "-m", "w", "--gen", "3")
    assert commands.srun(StepSpec(job_id="5", argv=["true"])).argv == (
        "srun", "--jobid=5", "true")
    with pytest.raises(SlurmSpecError, match="argv is empty"):
        StepSpec(job_id="5", argv=[])
    with pytest.raises(SlurmSpecError, match="not one string"):
        StepSpec(job_id="5", argv="hostname")
    with pytest.raises(SlurmSpecError, match="names 2 nodes but nodes is 1"):
        StepSpec(job_id="5", argv=["x"], nodes=1, nodelist=("n1", "n2"))


def test_step_environment_drops_the_enclosing_jobs_variables():
    env = {"PATH": "/bin", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]",
           "SLURM_CONF": "/x/slurm.conf", "CUDA_VISIBLE_DEVICES": "0",
           "SLURM_ETC_INJECT": "before-commit@3,1", "SLURM_STEP_ID": "0"}
    # the job's own variables go; the cluster and slurm-etc's own settings stay
    assert commands.step_environment(env) == {"PATH": "/bin", "SLURM_CONF": "/x/slurm.conf",
                                              "CUDA_VISIBLE_DEVICES": "0",
                                              "SLURM_ETC_INJECT": "before-commit@3,1"}


def test_signal_resize_node_state_commands():
    assert commands.scancel_signal("9", "SIGUSR2", batch=True).argv == (
        "scancel", "--signal=USR2", "--batch", "9")
    assert commands.scancel_signal("9", "TERM", full=True).argv == (
        "scancel", "--signal=TERM", "--full", "9")
    with pytest.raises(SlurmSpecError, match="not both"):
        commands.scancel_signal("9", "USR2", batch=True, full=True)
    assert commands.scontrol_resize("9", 1, cwd="/tmp").argv == (
        "scontrol", "update", "JobId=9", "NumNodes=1")
    with pytest.raises(SlurmSpecError, match="cancel the job"):
        commands.scontrol_resize("9", 0)
    assert commands.scontrol_node_state(["n3"], NodeAdminState.DOWN, "lost").argv == (
        "scontrol", "update", "NodeName=n3", "State=DOWN", "Reason=lost")
    assert commands.scontrol_node_state("n3", NodeAdminState.RESUME).argv == (
        "scontrol", "update", "NodeName=n3", "State=RESUME")
    with pytest.raises(SlurmSpecError, match="needs a reason"):
        commands.scontrol_node_state(["n3"], NodeAdminState.DRAIN)


def test_query_commands():
    argv = commands.squeue(["3", "4"]).argv
    assert argv[:3] == ("squeue", "--noheader", "--all")
    assert argv[-2:] == ("--jobs=3,4", "--states=all")
    assert "--states=all" not in commands.squeue(user="root").argv
    assert commands.scontrol_show_job("3").argv == ("scontrol", "--oneliner", "show", "job",
                                                    "3")
    assert commands.sinfo_nodes(["n1", "n2"]).argv[-1] == "--nodes=n1,n2"


def test_job_state_table():
    assert job_state("RUNNING") is SlurmJobState.RUNNING
    assert job_state("CANCELLED by 0") is SlurmJobState.CANCELLED
    assert job_state("CG") is SlurmJobState.ENDING
    assert job_state("PREEMPTED") is SlurmJobState.PREEMPTED
    assert job_state("BOOT_FAIL") is SlurmJobState.NODE_FAIL
    assert job_state("SOMETHING_NEW") is SlurmJobState.UNKNOWN
    assert all(isinstance(v, SlurmJobState) for v in SLURM_JOB_STATES.values())
    assert SlurmJobState.RUNNING.holds_resources and not SlurmJobState.PENDING.holds_resources
    assert SlurmJobState.TIMEOUT.finished and not SlurmJobState.REQUEUED.finished


@pytest.mark.parametrize("raw,state,responding", [
    ("idle", NodeState.IDLE, True),
    ("idle*", NodeState.IDLE, False),
    ("down*", NodeState.DOWN, False),
    ("drained", NodeState.DRAINED, True),
    ("draining", NodeState.DRAINING, True),
    ("mixed-", NodeState.MIXED, True),
    ("planned", NodeState.IDLE, True),
    ("idle~", NodeState.IDLE, True),
    ("IDLE+DRAIN", NodeState.DRAINED, True),
    ("MIXED+DRAIN", NodeState.DRAINING, True),
    ("DOWN+DRAIN+NOT_RESPONDING", NodeState.DOWN, False),
    ("weird", NodeState.UNKNOWN, True),
])
def test_node_state_table(raw, state, responding):
    assert node_state(raw) == (state, responding)


def test_runner_errors_are_one_clear_line():
    runner = SlurmRunner(timeout=5)
    fail = Command((sys.executable, "-c", "import sys; sys.stderr.write('no\\nway\\n'); "
                    "sys.exit(3)"))
    with pytest.raises(SlurmError) as err:
        runner.run(fail)
    assert err.value.returncode == 3 and "\n" not in str(err.value)
    assert "(exit 3): no | way" in str(err.value)
    assert runner.run(fail, check=False).returncode == 3
    with pytest.raises(SlurmError, match=r"timed out after 0.2 s"):
        runner.run(Command((sys.executable, "-c", "import time; time.sleep(5)")), timeout=0.2)
    with pytest.raises(SlurmError, match="not found on PATH"):
        runner.run(Command(("no-such-slurm-command-xyz",)))
    echo = Command((sys.executable, "-c", "import sys; print(sys.stdin.read().upper())"),
                   stdin="abc")
    assert runner.run(echo).stdout == "ABC\n"


def test_cli_client_is_a_slurm_client():
    assert isinstance(CliSlurmClient(), SlurmClient)
