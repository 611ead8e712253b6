"""Pure builders of Slurm command lines. Nothing here runs anything.

Output formats are chosen to parse the same on Slurm 22.05 and 24.11: squeue/sinfo ``-O``
fields with a ``|`` suffix (no padding, no truncation), ``scontrol show -o`` (one record per
line). ``--json`` exists on both releases but with different schemas (and on 22.05 it ignores
``-j``/``-t``), so it is not used.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from .model import BatchSpec, Command, NodeAdminState, SlurmSpecError, StepSpec, check_signal

SEP = "|"

# squeue -O fields, in the order parsers.parse_squeue reads them. Name is last: it is the
# only free text, and may itself contain the separator.
SQUEUE_FIELDS = ("JobID", "State", "Partition", "NumNodes", "NodeList", "BatchHost", "Reason",
                 "PreemptTime", "UserName", "Name")

# sinfo -N -O fields, in the order parsers.parse_sinfo_nodes reads them; Reason (free text)
# last. sinfo prints one row per (node, partition).
SINFO_FIELDS = ("NodeList", "StateLong", "CPUs", "Gres", "GresUsed", "Partition", "Reason")


def _fields(names: Sequence[str]) -> str:
    return ",".join(f"{name}:{SEP}" for name in names)


def sbatch(spec: BatchSpec) -> Command:
    """``sbatch --parsable [options]`` with the script on stdin; prints ``jobid[;cluster]``."""
    argv = ["sbatch", "--parsable"]
    if spec.name:
        argv.append(f"--job-name={spec.name}")
    if spec.partition:
        argv.append(f"--partition={spec.partition}")
    if spec.account:
        argv.append(f"--account={spec.account}")
    if spec.qos:
        argv.append(f"--qos={spec.qos}")
    if spec.nodes is not None:
        argv.append(f"--nodes={spec.nodes}")
    if spec.ntasks_per_node is not None:
        argv.append(f"--ntasks-per-node={spec.ntasks_per_node}")
    if spec.cpus_per_task is not None:
        argv.append(f"--cpus-per-task={spec.cpus_per_task}")
    if spec.gpus_per_node:
        argv.append(f"--gres=gpu:{spec.gpus_per_node}")
    if spec.exclusive:
        argv.append("--exclusive")
    if spec.nodelist:
        argv.append(f"--nodelist={','.join(spec.nodelist)}")
    if spec.exclude:
        argv.append(f"--exclude={','.join(spec.exclude)}")
    if spec.time_limit:
        argv.append(f"--time={spec.time_limit}")
    if spec.signal:
        argv.append(f"--signal={'B:' if spec.signal_batch_only else ''}{spec.signal}")
    if spec.requeue is True:
        argv.append("--requeue")
    elif spec.requeue is False:
        argv.append("--no-requeue")
    if spec.output:
        argv.append(f"--output={spec.output}")
    if spec.error:
        argv.append(f"--error={spec.error}")
    if spec.workdir:
        argv.append(f"--chdir={spec.workdir}")
    if spec.dependency:
        argv.append(f"--dependency={spec.dependency}")
    if spec.hold:
        argv.append("--hold")
    argv.extend(spec.extra)
    return Command(tuple(argv), stdin=spec.script)


def scancel(job_id: str) -> Command:
    """Cancel a job (SIGTERM to its steps and batch shell, SIGKILL after KillWait)."""
    return Command(("scancel", str(job_id)))


def scancel_signal(job_id: str, signal: str, *, batch: bool = False,
                   full: bool = False) -> Command:
    """Send ``signal`` to a job's steps; ``batch``: to the batch shell only (not its
    children); ``full``: to the batch shell, its children and every step."""
    if batch and full:
        raise SlurmSpecError("choose batch (batch shell only) or full (everything), not both")
    argv = ["scancel", f"--signal={check_signal(signal)}"]
    if batch:
        argv.append("--batch")
    if full:
        argv.append("--full")
    argv.append(str(job_id))
    return Command(tuple(argv))


def squeue(job_ids: Sequence[str] = (), *, user: str | None = None,
           partition: str | None = None, name: str | None = None,
           all_states: bool = False) -> Command:
    """List jobs, one ``|``-separated line each (:data:`SQUEUE_FIELDS`).

    With job ids every state is listed (finished jobs until MinJobAge); otherwise only
    pending, running and completing jobs unless ``all_states``.
    """
    argv = ["squeue", "--noheader", "--all", f"--Format={_fields(SQUEUE_FIELDS)}"]
    if job_ids:
        argv.append(f"--jobs={','.join(str(j) for j in job_ids)}")
    if job_ids or all_states:
        argv.append("--states=all")
    if user:
        argv.append(f"--user={user}")
    if partition:
        argv.append(f"--partition={partition}")
    if name:
        argv.append(f"--name={name}")
    return Command(tuple(argv))


def scontrol_show_job(job_id: str | None = None) -> Command:
    """Every field of one job (or all jobs), one line per job."""
    argv = ["scontrol", "--oneliner", "show", "job"]
    if job_id is not None:
        argv.append(str(job_id))
    return Command(tuple(argv))


def scontrol_show_partition(name: str) -> Command:
    """Every field of one partition (GraceTime, PreemptMode, PriorityTier...), one line."""
    return Command(("scontrol", "--oneliner", "show", "partition", name))


def sinfo_nodes(nodes: Sequence[str] = ()) -> Command:
    """Node states, one ``|``-separated line per (node, partition) (:data:`SINFO_FIELDS`)."""
    argv = ["sinfo", "--noheader", "--Node", f"--Format={_fields(SINFO_FIELDS)}"]
    if nodes:
        argv.append(f"--nodes={','.join(nodes)}")
    return Command(tuple(argv))


def scontrol_resize(job_id: str, num_nodes: int, *, cwd: str | None = None) -> Command:
    """Shrink a running job to ``num_nodes`` (``NumNodes=``). Run inside the job, scontrol
    writes ``slurm_job_<id>_resize.{sh,csh}`` into ``cwd``."""
    if num_nodes < 1:
        raise SlurmSpecError(f"num_nodes ({num_nodes}) must be at least 1; cancel the job to "
                             "release all of it")
    return Command(("scontrol", "update", f"JobId={job_id}", f"NumNodes={num_nodes}"), cwd=cwd)


def scontrol_node_state(nodes: Sequence[str], state: NodeAdminState,
                        reason: str | None = None) -> Command:
    """Set nodes DOWN/DRAIN (a reason is required) or RESUME/UNDRAIN them."""
    if isinstance(nodes, str):
        nodes = (nodes,)
    if not nodes:
        raise SlurmSpecError("name at least one node")
    if state.needs_reason and not (reason and reason.strip()):
        raise SlurmSpecError(f"State={state.value} needs a reason (Slurm refuses it without)")
    argv = ["scontrol", "update", f"NodeName={','.join(nodes)}", f"State={state.value}"]
    if reason:
        argv.append(f"Reason={reason}")
    return Command(tuple(argv))


def srun(step: StepSpec) -> Command:
    """``srun --jobid=<id> ... argv``: a step in an existing allocation.

    Launch it with :func:`step_environment` (a caller inside another job would otherwise
    pass that job's SLURM_* variables along). ``srun`` exits 0 even when its step was
    preempted or lost a node: judge a step by Slurm's job state, not by srun's exit code.
    """
    argv = ["srun", f"--jobid={step.job_id}"]
    if step.nodes is not None:
        argv.append(f"--nodes={step.nodes}")
    if step.ntasks is not None:
        argv.append(f"--ntasks={step.ntasks}")
    if step.ntasks_per_node is not None:
        argv.append(f"--ntasks-per-node={step.ntasks_per_node}")
    if step.nodelist:
        argv.append(f"--nodelist={','.join(step.nodelist)}")
    if step.cpus_per_task is not None:
        argv.append(f"--cpus-per-task={step.cpus_per_task}")
    if step.gpus_per_task is not None:
        argv.append(f"--gpus-per-task={step.gpus_per_task}")
    if step.overlap:
        argv.append("--overlap")
    if step.label:
        argv.append("--label")
    if step.kill_on_bad_exit:
        argv.append("--kill-on-bad-exit=1")
    if step.signal:
        sig, _, secs = step.signal.partition("@")
        argv.append(f"--signal={check_signal(sig)}{'@' + secs if secs else ''}")
    if step.output:
        argv.append(f"--output={step.output}")
    if step.error:
        argv.append(f"--error={step.error}")
    argv.extend(step.extra)
    argv.extend(step.argv)
    return Command(tuple(argv))


def step_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without the SLURM_* variables of the job we may be running in: a step
    launched from an anchor's batch script must not inherit the anchor's node list, GPUs and
    job name. SLURM_CONF (which cluster) and slurm-etc's own SLURM_ETC_* (the workers' settings,
    e.g. SLURM_ETC_INJECT) are kept."""
    return {k: v for k, v in environ.items()
            if not k.startswith("SLURM_") or k == "SLURM_CONF" or k.startswith("SLURM_ETC_")}
