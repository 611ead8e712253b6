"""`slurm-etc run`: start the coordinator of one elastic job around a worker command."""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import click

from ..plan import load_model
from ..plan.errors import ConfigError


def job_id_default() -> str:
    return os.environ.get("SLURM_JOB_ID") or f"job-{os.getpid()}-{int(time.time())}"


@click.command(context_settings={"ignore_unknown_options": False})
@click.option("--backend", type=click.Choice(["local", "slurm"]), default="local",
              show_default=True, help="Where devices and workers come from.")
@click.option("--events", "events_file", type=click.Path(dir_okay=False, path_type=Path),
              help="Local backend: the scripted cluster (JSON; see docs/coordinator.md).")
@click.option("--nodes", type=click.IntRange(min=1), default=2, show_default=True,
              help="Local backend without --events: simulated nodes.")
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--model", "model_spec", required=True,
              help="Preset or model JSON the workers train (planning and the chooser).")
@click.option("--global-batch", type=click.IntRange(min=1), required=True)
@click.option("--micro-batch", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--distributed-optimizer", is_flag=True)
@click.option("--policy-partition", help="Partition whose resize policy applies.")
@click.option("--account", help="Account whose resize policy applies.")
@click.option("--policy-db", help="Policy database (default: the policy store).")
@click.option("--job-id", default=job_id_default, help="Default: $SLURM_JOB_ID.")
@click.option("--name", default="elastic", show_default=True)
@click.option("--db", help="The job's record: SQLite path or SQLAlchemy URL (default: "
                           "node-local SQLite, published to --state-dir).")
@click.option("--state-dir", type=click.Path(file_okay=False), help="Where snapshots go.")
@click.option("--bind", default="127.0.0.1", show_default=True,
              help="Address the control channel and rendezvous store listen on.")
@click.option("--advertise", help="Address workers connect to (needed with --bind 0.0.0.0).")
@click.option("--timeout", "timeout_s", type=float, default=300.0, show_default=True,
              help="Bound of every worker collective and resize (seconds).")
@click.option("--json", "as_json", is_flag=True, help="A JSON summary on stdout at the end.")
@click.argument("command", nargs=-1, required=True)
def run(backend, events_file, nodes, gpus_per_node, model_spec, global_batch, micro_batch,
        distributed_optimizer, policy_partition, account, policy_db, job_id, name, db,
        state_dir, bind, advertise, timeout_s, as_json, command):
    """Coordinate one elastic job: COMMAND is the worker (a training script ending in
    ``slurm_etc.worker.entry.run_worker``), started once per device.

    \b
    slurm-etc run --model tiny --global-batch 8 --events cluster.json -- \\
        python -m slurm_etc.worker.preset_worker --model tiny --global-batch 8
    """
    from ..alloc.chooser import Hardware, TrainingJob
    from ..coordinator.loop import JobSpec
    from ..coordinator.policy_lookup import job_policy
    from ..coordinator.run import run_job

    model = load_model(model_spec)
    job = TrainingJob(model, global_batch, micro_batch, distributed_optimizer)
    policy = job_policy(policy_partition, account, policy_db)
    if backend == "local":
        from ..coordinator.events import ScriptError, load_script, script_from_options
        from ..coordinator.local_backend import LocalBackend

        try:
            script = (load_script(events_file) if events_file
                      else script_from_options(nodes, gpus_per_node))
        except ScriptError as err:
            raise ConfigError(str(err)) from None
        be = LocalBackend(script)
        topology = be.topology
    else:
        try:
            from ..slurm.backend import SlurmBackend
        except ImportError:
            raise ConfigError("the Slurm backend is not available in this build") from None
        be = SlurmBackend.from_environment(job_id=job_id, policy=policy)
        topology = be.topology
    hardware = Hardware(gpus_per_node=topology.gpus_per_node)
    spec = JobSpec(job_id, name, tuple(command), job, policy, hardware, timeout_s)
    logging.getLogger("slurm_etc").setLevel(min(logging.INFO,
                                                logging.getLogger().getEffectiveLevel()))
    out = run_job(spec, be, topology, backend_name=backend, db=db, state_dir=state_dir,
                  bind=bind, advertise=advertise)
    if as_json:
        click.echo(json.dumps(out))
    if out["state"] != "finished":
        raise SystemExit(1)
