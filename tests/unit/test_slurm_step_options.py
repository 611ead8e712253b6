"""A site's and a user's own srun options for the worker steps (issue #44, part 4): read
from the site's file, $SLURM_ETC_SRUN_ARGS and --srun-arg, in that order; the options the
coordinator places steps with are refused in one line; nothing reaches the coordinator's
own Slurm commands."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from slurm_etc.plan.errors import ConfigError
from slurm_etc.slurm import commands
from slurm_etc.slurm.backend import TaskSpec, member_job_spec, worker_step_spec
from slurm_etc.slurm.step_options import check, step_options, words

pytestmark = pytest.mark.unit

SLURM_ETC = os.path.join(os.path.dirname(sys.executable), "slurm-etc")


def test_site_then_job_then_command_line(tmp_path):
    site = tmp_path / "srun-args"
    site.write_text("# pyxis on every step\n--container-image=/img/pt.sqsh \\\n"
                    "  --container-mounts='/shared:/shared'\n")
    env = {"SLURM_ETC_SRUN_ARGS": "--cpu-bind=none --export=ALL,A='x y'"}
    assert step_options(env, ["--mpi=pmix"], site_file=str(site)) == (
        "--container-image=/img/pt.sqsh", "--container-mounts=/shared:/shared",
        "--cpu-bind=none", "--export=ALL,A=x y", "--mpi=pmix")
    assert step_options({}, site_file=str(tmp_path / "none")) == ()  # no site file: none
    env = {"SLURM_ETC_SITE_SRUN_ARGS_FILE": str(site)}
    assert step_options(env)[0] == "--container-image=/img/pt.sqsh"


@pytest.mark.parametrize("arg", ["--nodes=2", "-N2", "--nodelist=n3", "-w", "--jobid=9",
                                 "--overlap", "--input=none", "--label", "--output=x",
                                 "--gpus-per-task=1", "-n", "--ntasks=4"])
def test_what_places_the_step_is_the_coordinator_s(arg):
    with pytest.raises(ConfigError) as err:
        check(["--cpu-bind=none", arg], "--srun-arg")
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"--srun-arg: {arg!r} is the coordinator's own")


def test_unreadable_words_are_one_line():
    with pytest.raises(ConfigError, match="SLURM_ETC_SRUN_ARGS: cannot read it as shell words"):
        words("--export='unclosed", "SLURM_ETC_SRUN_ARGS")


def test_only_worker_steps_get_them():
    options = ("--container-image=/img/pt.sqsh",)
    step = commands.srun(worker_step_spec(allocation="7", node="n1", python="/py",
                                          tasks=[TaskSpec(0, 0, {})], argv=["train"],
                                          options=options))
    assert step.argv[step.argv.index("--wait=0") + 1] == options[0]  # after the step's own
    assert step.argv.index(options[0]) < step.argv.index("/py")  # before the program
    member = commands.sbatch(member_job_spec(anchor_job="7", key="grow-1", nodes=1,
                                             gpus_per_node=2, run_dir="/r", python="/py"))
    assert options[0] not in " ".join(member.argv) + (member.stdin or "")


def test_the_local_backend_refuses_them_in_one_line(tmp_path):
    run = subprocess.run([SLURM_ETC, "run", "--srun-arg=--cpu-bind=none", "--db",
                          str(tmp_path / "j.db"), "--job-id", "x", "--", "true"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        "slurm-etc: --srun-arg adds options to the Slurm backend's worker steps; the local "
        "backend starts processes (use --backend slurm)"] or \
        "--srun-arg adds options to the Slurm backend's worker steps" in run.stderr
    assert not (tmp_path / "j.db").exists()
