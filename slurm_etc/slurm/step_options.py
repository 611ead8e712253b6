"""Options a site or a user adds to every worker step's ``srun`` (containers, binding,
networks): ``srun --container-image=... --container-mounts=...`` under pyxis/enroot,
``--mpi``, ``--cpu-bind``, ``--network``, ``--export``. Pure.

Where they come from, in this order (srun lets a later option win):

1. the site's defaults, one file the admin keeps (:data:`SITE_FILE`, or the file named by
   ``SLURM_ETC_SITE_SRUN_ARGS_FILE``): shell words, ``#`` comments;
2. the job's ``SLURM_ETC_SRUN_ARGS`` (shell words; the wrapper passes it on);
3. ``slurm-etc run --srun-arg ARG`` (repeatable).

They go verbatim to every worker step and nowhere else: the coordinator's own Slurm
commands (``squeue``, ``scontrol``, ``sbatch`` of members, ``scancel``) never see them. The
options the coordinator places each step with are its own and are refused in one line.
"""
from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

from slurm_etc.plan.errors import ConfigError

SITE_FILE: Final = "/etc/slurm-etc/srun-args"
SITE_FILE_VAR: Final = "SLURM_ETC_SITE_SRUN_ARGS_FILE"
JOB_VAR: Final = "SLURM_ETC_SRUN_ARGS"

# what each worker step's placement and plumbing rest on (slurm/backend.py worker_step_spec)
OWNED: Final = {
    "--jobid": "the allocation of the step", "-N": "one node per step",
    "--nodes": "one node per step", "-n": "one task per worker",
    "--ntasks": "one task per worker", "-w": "the node the devices are on",
    "--nodelist": "the node the devices are on", "--overlap": "steps beside each other",
    "--input": "the stop and kill lines on stdin", "-i": "the stop and kill lines on stdin",
    "--kill-on-bad-exit": "one worker's exit leaves the others",
    "-K": "one worker's exit leaves the others", "--wait": "one worker's exit leaves the others",
    "-W": "one worker's exit leaves the others", "--label": "the step log's vrank labels",
    "-l": "the step log's vrank labels", "--error": "the step log", "-e": "the step log",
    "--output": "the step's reports to the coordinator", "-o": "the step's reports",
    "--gpus-per-task": "one GPU per worker, chosen by the coordinator",
}


def check(args: Sequence[str], source: str) -> tuple[str, ...]:
    """``args`` as given, or ConfigError naming the first option the coordinator owns."""
    for arg in args:
        name = arg.split("=", 1)[0] if arg.startswith("--") else arg[:2]
        if name in OWNED:
            raise ConfigError(f"{source}: {arg!r} is the coordinator's own ({OWNED[name]}); "
                              "add options that do not place the step (e.g. "
                              "--container-image=..., --cpu-bind=..., --export=ALL,VAR=x)")
    return tuple(args)


def words(text: str, source: str) -> tuple[str, ...]:
    """Shell words of ``text`` (``#`` comments allowed), checked."""
    try:
        parsed = shlex.split(text.replace("\\\n", " "), comments=True)  # continued lines
    except ValueError as err:
        raise ConfigError(f"{source}: cannot read it as shell words ({err})") from None
    return check(parsed, source)


def step_options(environ: Mapping[str, str], given: Sequence[str] = (), *,
                 site_file: str | None = None) -> tuple[str, ...]:
    """Every worker step's extra srun options: the site's, the job's, then ``given``."""
    path = Path(site_file or environ.get(SITE_FILE_VAR) or SITE_FILE)
    site: tuple[str, ...] = ()
    try:
        site = words(path.read_text(), str(path))
    except FileNotFoundError:
        pass
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the site's srun options "
                          f"({err.strerror})") from None
    job = words(environ.get(JOB_VAR, ""), JOB_VAR)
    return site + job + check(list(given), "--srun-arg")
