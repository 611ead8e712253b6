"""`slurm-etc run`: start the coordinator of one elastic job around a worker command."""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import IO, Callable

import click

from .. import bounds
from ..alloc.chooser import Hardware
from ..alloc.hardware import FIELDS, PROFILES, hardware_from
from ..coordinator.outlook import DEFAULT_GIVE_UP_AFTER_S
from ..plan import load_model
from ..plan.errors import ConfigError
from ..protocol.env import DEFAULT_REATTACH_WAIT_S
from ..protocol.recovery import AUTO, AUTO_WORD, DEFAULT_KEEP_CHECKPOINTS, Recovery
from .params import Number, NumberOrWord, SafePath, Text, Unbounded, check_product

_ANY_MODEL = load_model("tiny")  # what --global-batch alone is checked with


def job_id_default() -> str:
    return os.environ.get("SLURM_JOB_ID") or f"job-{os.getpid()}-{int(time.time())}"


def load_hardware(value: str) -> Hardware:
    """A profile name, or a JSON file of device figures (one line on any mistake)."""
    if value in PROFILES:
        return PROFILES[value]
    path = Path(value)
    if not path.suffix == ".json" and not path.exists():
        raise ConfigError(f"--hardware {value!r}: not a profile ({', '.join(PROFILES)}) "
                          "nor a JSON file of device figures")
    try:
        figures = bounds.load_json(bounds.read_capped(path))
    except bounds.BoundError as err:
        raise ConfigError(f"--hardware {value}: {err}") from None
    except RecursionError:
        raise ConfigError(f"--hardware {value}: nests too deeply to be device figures"
                          ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"--hardware {value}: cannot read it ({err.__class__.__name__}: "
                          f"{getattr(err, 'strerror', None) or err})") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"--hardware {value}: not JSON ({err.msg} at line {err.lineno}); "
                          f"expected an object such as {{\"base\": \"h100\", "
                          f"\"memory_gib\": 40}}") from None
    return hardware_from(figures, f"--hardware {value}")


def open_progress(path: Path | None
                  ) -> tuple[Callable[[dict], None] | None, IO[str] | None]:
    """An appender of one JSON line per step (with its wall-clock time), or None."""
    if path is None:
        return None, None
    try:
        out = open(path, "a", buffering=1)
    except OSError as err:
        raise ConfigError(f"--progress {path}: cannot append to it ({err.strerror})") from None

    def progress(p: dict) -> None:
        out.write(json.dumps({**p, "t": time.time()}) + "\n")

    return progress, out


def recovery_options(peer_copy_every: int, checkpoint_every: int,
                     checkpoint_dir: Path | None,
                     keep_checkpoints: int = DEFAULT_KEEP_CHECKPOINTS) -> Recovery:
    """The workers' peer-copy and checkpoint settings; the checkpoint directory is created
    (owner-only when new) and must be writable. One line on any mistake."""
    if checkpoint_dir is not None and not checkpoint_every and peer_copy_every != AUTO:
        raise ConfigError(f"--checkpoint-dir {checkpoint_dir} without --checkpoint-every: "
                          "give both (e.g. --checkpoint-every 100), or leave "
                          f"--peer-copy-every {AUTO_WORD} (checkpoints where copies do not "
                          "fit host memory)")
    where = None
    if checkpoint_dir is not None:
        where = checkpoint_dir.expanduser().absolute()
        try:
            where.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"--checkpoint-dir {checkpoint_dir}: cannot create it "
                              f"({err.strerror})") from None
        if not os.access(where, os.W_OK | os.X_OK):
            raise ConfigError(f"--checkpoint-dir {checkpoint_dir}: not writable by this user")
    return Recovery(peer_copy_every, checkpoint_every, None if where is None else str(where),
                    keep_checkpoints)


@click.command(context_settings={"ignore_unknown_options": False})
@click.option("--backend", type=click.Choice(["local", "slurm"]), default="local",
              show_default=True, help="Where devices and workers come from.")
@click.option("--events", "events_file", envvar="SLURM_ETC_RUN_EVENTS",
              type=SafePath(dir_okay=False, path_type=Path),
              help="Local backend: the scripted cluster (JSON; see docs/coordinator.md).")
@click.option("--nodes", type=Number(bounds.NODES), default=2, show_default=True,
              help="Local backend without --events: simulated nodes.")
@click.option("--gpus-per-node", type=Number(bounds.GPUS_PER_NODE), default=2,
              show_default=True)
@click.option("--model", "model_spec", envvar="SLURM_ETC_RUN_MODEL",
              type=Text(bounds.PATH_CHARS),
              help="Preset or model JSON the workers train. Default: the model the workers "
                   "build (each says it once built; the first layout runs dp only until "
                   "then). Given, it is checked against theirs: the job stops at once, "
                   "naming the first difference.")
@click.option("--global-batch", type=Number(bounds.BATCH),
              help="Sequences per step. Default: the training script's (the first layout "
                   "is one worker until its workers said it). Given, it is checked against "
                   "theirs, with --micro-batch.")
@click.option("--micro-batch", type=Number(bounds.BATCH),
              help="Sequences per micro batch of one model replica. With --global-batch: "
                   "default 1. Without: default the training script's; given, the "
                   "workers' must be it (the job stops at once, naming both) and the global "
                   "batch is theirs.")
@click.option("--distributed-optimizer", is_flag=True)
@click.option("--policy-partition", type=Text(), help="Partition whose resize policy applies.")
@click.option("--account", type=Text(), help="Account whose resize policy applies.")
@click.option("--policy-db", type=Text(bounds.PATH_CHARS),
              help="Your own policy database: it can only make the site's "
                   "(/etc/slurm-etc/policies.db) stricter.")
@click.option("--job-id", type=Text(), default=job_id_default, help="Default: $SLURM_JOB_ID.")
@click.option("--name", type=Text(), default="elastic", show_default=True)
@click.option("--db", type=Text(bounds.PATH_CHARS),
              help="The job's record: SQLite path, SQLAlchemy URL or @FILE (the URL in an "
                   "owner-only file: no password in argv) (default: node-local SQLite, "
                   "published to --state-dir).")
@click.option("--state-dir", type=SafePath(file_okay=False), help="Where snapshots go.")
@click.option("--bind", type=Text(), default="127.0.0.1", show_default=True,
              help="Address the control channel and rendezvous store listen on.")
@click.option("--advertise", type=Text(bounds.PATH_CHARS),
              help="Address workers connect to (needed with --bind 0.0.0.0).")
@click.option("--timeout", "timeout_s", envvar="SLURM_ETC_RUN_TIMEOUT",
              type=Number(bounds.SECONDS, low=0.001), default=300.0, show_default=True,
              help="Bound of every worker collective and resize (seconds).")
@click.option("--hardware", type=Text(bounds.PATH_CHARS), default="h100", show_default=True,
              metavar="PROFILE|FILE.json",
              help="The devices' figures the layout chooser ranks layouts with: a profile ("
                   + ", ".join(PROFILES) + "; cpu: worker processes on CPUs) or a JSON "
                   "object of " + ", ".join(FIELDS) + " (missing ones from its \"base\" "
                   "profile, default h100). GPUs per node always come from the cluster.")
@click.option("--peer-copy-every", type=NumberOrWord(bounds.STEPS, AUTO_WORD, AUTO),
              default=AUTO_WORD, show_default=True, metavar="auto|N",
              help="Every N steps each worker copies its state to host memory on another "
              "node, so that a node lost without grace where no data-parallel replica holds "
              "its state (dp=1, distributed-optimizer shards) costs at most the steps since "
              "(rolled back, checked against the copy's fingerprint, trained again). auto: "
              "the workers choose N once, at start, so that copying costs about 2% of step "
              "time and fits host memory (one line says it; status shows it); where it "
              "does not fit, periodic checkpoints into --checkpoint-dir if given. 0: off.")
@click.option("--checkpoint-every", type=Number(bounds.STEPS), default=0,
              show_default=True, metavar="M", help="A megatron-core checkpoint every M steps "
              "into --checkpoint-dir (the newest --keep-checkpoints kept): the fallback when "
              "a node and the node holding its peer copy are lost together, and where a "
              "restarted job trains on from (the newest complete one). 0: off (with "
              "--checkpoint-dir and --peer-copy-every auto: chosen like the copies' interval "
              "when the copies do not fit host memory).")
@click.option("--keep-checkpoints", type=Number(bounds.KEPT_CHECKPOINTS),
              default=DEFAULT_KEEP_CHECKPOINTS, show_default=True, metavar="K",
              help="How many of the newest complete checkpoints stay; an older one is "
                   "deleted only once a newer one is complete.")
@click.option("--checkpoint-dir", type=SafePath(file_okay=False, path_type=Path),
              help="Where --checkpoint-every writes (storage every node reaches); with "
                   "--peer-copy-every auto alone, where checkpoints go if the copies do not "
                   "fit host memory.")
@click.option("--reattach-wait", type=Number(bounds.REATTACH_WAIT_S),
              default=DEFAULT_REATTACH_WAIT_S, show_default=True, metavar="SECONDS",
              help="How long a worker that hears nothing from this coordinator (a heartbeat "
                   "every few seconds) waits for it before it exits; it trains no step "
                   "meanwhile.")
@click.option("--join-timeout", type=Number(bounds.SECONDS, low=1),
              default=300.0, show_default=True, metavar="SECONDS",  # loop's default too
              help="How long a launched worker has to join the job (say hello on the "
                   "control channel). One that exits or stays silent before never joins: "
                   "in the first layout the job fails with one line; a joiner's resize ends "
                   "without pausing anyone.")
@click.option("--give-up-after", type=Number(bounds.SECONDS, low=1),
              default=DEFAULT_GIVE_UP_AFTER_S, show_default=True, metavar="SECONDS",
              help="How long the job waits with nothing to train on (no device its model "
                   "fits, every worker gone) and no node request that can still be met "
                   "before it ends failed, with one line saying why. A pending request "
                   "that can be met keeps it waiting (status says for what).")
@click.option("--progress", "progress_file", envvar="SLURM_ETC_RUN_PROGRESS",
              type=SafePath(dir_okay=False, path_type=Path),
              help="Append one JSON line per training step (step, loss, lr, layout, "
                   "generation, t) to this file.")
@click.option("--json", "as_json", envvar="SLURM_ETC_RUN_JSON", is_flag=True,
              help="A JSON summary on stdout at the end.")
@click.option("--preload/--no-preload", envvar="SLURM_ETC_RUN_PRELOAD", default=True,
              show_default=True,
              help="Local backend: workers that are 'python -m module' or 'python "
                   "script.py' fork from one process that imported torch and megatron-core "
                   "(seconds per worker saved); --no-preload: each starts cold.")
@click.option("--metrics-port", type=Number(bounds.PORT), default=None, metavar="PORT",
              help="Serve this job's metrics (OpenMetrics, /metrics) for Prometheus on this "
                   "port (0: any free one, logged); off by default.")
@click.option("--metrics-bind", type=Text(), default="127.0.0.1", show_default=True,
              metavar="ADDR",
              help="The address --metrics-port listens on.")
@click.option("--srun-arg", "srun_args", type=Text(bounds.PATH_CHARS), multiple=True,
              metavar="ARG", envvar="SLURM_ETC_RUN_SRUN_ARG",
              help="Slurm backend: an option added verbatim to every worker step's srun "
                   "(repeatable; after the site's /etc/slurm-etc/srun-args and "
                   "$SLURM_ETC_SRUN_ARGS), e.g. --srun-arg=--container-image=img.sqsh; "
                   "never to the coordinator's own Slurm commands.")
@click.argument("command", nargs=-1, required=True, type=Unbounded(
    "the worker's own command line, run as given: its arguments are the user's program's"))
def run(backend, events_file, nodes, gpus_per_node, model_spec, global_batch, micro_batch,
        distributed_optimizer, policy_partition, account, policy_db, job_id, name, db,
        state_dir, bind, advertise, timeout_s, hardware, peer_copy_every, checkpoint_every,
        keep_checkpoints, checkpoint_dir, reattach_wait, join_timeout, give_up_after,
        progress_file, as_json, preload, metrics_port, metrics_bind, srun_args, command):
    """Coordinate one elastic job: COMMAND is the worker (a training script ending in
    ``slurm_etc.worker.entry.run_worker``), started once per device. Generations,
    migrations, events and decisions are logged on stderr as they happen.

    Every option can also be given as an environment variable SLURM_ETC_RUN_<OPTION>
    (e.g. SLURM_ETC_RUN_HARDWARE=cpu), which is how scripts/elastic.sbatch passes them on.

    \b
    slurm-etc run --events cluster.json -- python my_train.py
    slurm-etc run --model tiny --global-batch 8 --events cluster.json -- \\
        python -m slurm_etc.worker.preset_worker --model tiny --global-batch 8
    """
    from ..alloc.chooser import TrainingJob
    from ..coordinator.policy_lookup import job_policy
    from ..protocol.channel import ChannelError, check_addresses

    try:
        check_addresses(bind, advertise)
    except ChannelError as err:
        raise ConfigError(str(err)) from None
    model = load_model(model_spec) if model_spec else None
    micro_batch_given = micro_batch is not None
    micro_batch = micro_batch or 1
    figures = load_hardware(hardware)
    if global_batch is not None:
        TrainingJob(model or _ANY_MODEL, global_batch, micro_batch,
                    distributed_optimizer)  # checks the batch
    script = None
    if backend == "local":  # every input checked before anything is created or opened
        script = _local_script(events_file, nodes, gpus_per_node)
    recovery = recovery_options(peer_copy_every, checkpoint_every, checkpoint_dir,
                                keep_checkpoints)
    policy = job_policy(policy_partition, account, policy_db)
    if srun_args and script is not None:
        raise ConfigError("--srun-arg adds options to the Slurm backend's worker steps; the "
                          "local backend starts processes (use --backend slurm)")
    be = _backend(script, preload, job_id, policy, srun_args)
    topology = be.topology
    # the job's own machinery, once all is checked
    from ..coordinator.job import JobSpec
    from ..coordinator.job_model import provisional_job
    from ..coordinator.run import run_job

    job = provisional_job(model, global_batch, micro_batch, distributed_optimizer)
    spec = JobSpec(job_id, name, tuple(command), job, policy,
                   replace(figures, gpus_per_node=topology.gpus_per_node), timeout_s,
                   recovery=recovery, reattach_wait_s=reattach_wait,
                   join_timeout_s=float(join_timeout),
                   give_up_after_s=float(give_up_after), model_from_workers=model is None,
                   batch_from_workers=global_batch is None,
                   micro_batch_given=global_batch is None and micro_batch_given,
                   model_label=f"--model {model_spec}")
    _log_with_times()
    progress, progress_out = open_progress(progress_file)
    try:
        out = run_job(spec, be, topology, backend_name=backend, db=db, state_dir=state_dir,
                      bind=bind, advertise=advertise, progress=progress,
                      metrics=(metrics_bind, metrics_port) if metrics_port is not None else None)
    finally:
        if progress_out is not None:
            progress_out.close()
    _report(out, [str(e) for e in be.unfired] if script is not None else [], spec.job_id,
            as_json)


def _local_script(events_file, nodes, gpus_per_node):
    """The local cluster's events script: the file's, else one of ``nodes`` x
    ``gpus_per_node`` (checked against the processes one host may run)."""
    from ..local.script import ScriptError, load_script, script_from_options

    if not events_file:
        # the local backend runs a process per device it holds, all on this host
        check_product("the local cluster",
                      {"--nodes": nodes, "--gpus-per-node": gpus_per_node},
                      bounds.PROCESSES)
    try:
        return (load_script(events_file) if events_file
                else script_from_options(nodes, gpus_per_node))
    except ScriptError as err:
        raise ConfigError(str(err)) from None


def _backend(script, preload, job_id, policy, srun_args):
    """The local backend over ``script``, or (without one) the Slurm backend of the
    allocation this runs in."""
    if script is not None:
        from ..local.backend import LocalBackend

        return LocalBackend(script, preload=preload)
    try:
        from ..slurm.backend import SlurmBackend
    except ImportError:
        raise ConfigError("the Slurm backend is not available in this build") from None
    return SlurmBackend.from_environment(job_id=job_id, policy=policy, srun_args=srun_args)


def _log_with_times() -> None:
    """The package logs at INFO (or what the root logger lets through); lines on stderr
    carry their time (a job's output file)."""
    logging.getLogger("slurm_etc").setLevel(min(logging.INFO,
                                                logging.getLogger().getEffectiveLevel()))
    for handler in logging.getLogger().handlers:  # a job's output file: when, too
        if getattr(handler, "stream", None) is sys.stderr:
            handler.setFormatter(logging.Formatter(
                "%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))


def _report(out: dict, unfired: list[str], job_id: str, as_json: bool) -> None:
    """The events that did not play out (a warning), the JSON summary, the exit status."""
    if unfired:  # the events script asked for more than the job trained to show
        out = {**out, "unfired_events": unfired}
        click.echo(f"slurm-etc: warning: the events script did not play out: training ended "
                   f"at step {out['step']} before {'; '.join(unfired)} (give the workers "
                   f"more steps, or end training with the script's end_step)", err=True)
    if as_json:  # the job's id first: what `slurm-etc status JOB` takes
        click.echo(json.dumps({"job": job_id, **out}))
    if out.get("signal"):  # cancelled by a signal: the shell's convention
        raise SystemExit(128 + int(out["signal"]))
    if out["state"] != "finished":
        raise SystemExit(1)
