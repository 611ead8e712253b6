"""The two programs of tests/slurm/test_elastic_training.py's Slurm job.

``anchor``: what ``slurm-etc run --backend slurm`` does in scripts/elastic.sbatch (the
coordinator in the anchor's batch script: SlurmBackend.from_environment, the policy of the
anchor's partition from a policy database, the job's record), with two differences: the
chooser's hardware figures are those of CPU "devices" (the demo's: on H100 figures a model
as small as ``tiny`` never grows past one device), and every step the coordinator hears of
is appended to a JSON-lines file with its time, so that the test can compare the losses.

``worker``: the preset worker (``python -m slurm_etc.worker.preset_worker``), paced: while
the pace file exists each forward pass sleeps ``--pace-s`` (sleeping leaves the 2 cores to
the other processes and does not change a loss), so that the job is still training when the
test's events come; the test removes the file after its last event.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time


def anchor(args: argparse.Namespace) -> int:
    from slurm_etc.alloc.chooser import TrainingJob
    from slurm_etc.coordinator.demo import DEMO_HARDWARE
    from slurm_etc.coordinator.loop import JobSpec
    from slurm_etc.coordinator.policy_lookup import job_policy
    from slurm_etc.coordinator.run import run_job
    from slurm_etc.plan import load_model
    from slurm_etc.slurm.backend import SlurmBackend

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        stream=sys.stderr)
    # scancel / the time limit: a clean close (members cancelled, workers stopped)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    job_id = os.environ["SLURM_JOB_ID"]
    policy = job_policy(os.environ.get("SLURM_JOB_PARTITION", "main"), None, args.policy_db)
    backend = SlurmBackend.from_environment(job_id, policy)
    argv = (sys.executable, os.path.abspath(__file__), "worker", "--train-steps",
            str(args.train_steps), "--pace-file", args.pace_file, "--pace-s", str(args.pace_s))
    spec = JobSpec(job_id, "elastic-test", argv, TrainingJob(load_model("tiny"), 8, 1, False),
                   policy, DEMO_HARDWARE, worker_timeout_s=120.0,
                   env={"OMP_NUM_THREADS": "1"})
    out = open(args.progress, "a", buffering=1)

    def progress(p: dict) -> None:
        out.write(json.dumps({**p, "t": time.time()}) + "\n")

    result = run_job(spec, backend, backend.topology, backend_name="slurm", db=args.db,
                     state_dir=args.state_dir, progress=progress, deadline_s=args.deadline_s)
    print(json.dumps({"result": result}), flush=True)
    return 0 if result["state"] == "finished" else 1


def worker(args: argparse.Namespace) -> int:
    from slurm_etc.plan import load_model
    from slurm_etc.worker.entry import run_worker
    from slurm_etc.worker.gpt import preset_trainer

    trainer = preset_trainer(load_model("tiny"), distributed_optimizer=False, global_batch=8,
                             micro_batch=1, train_steps=args.train_steps)
    forward = trainer.forward_step

    def paced(data, model):  # type: ignore[no-untyped-def]
        if os.path.exists(args.pace_file):
            time.sleep(args.pace_s)
        return forward(data, model)

    trainer.forward_step = paced
    return run_worker(trainer)


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("anchor")
    a.add_argument("--db")
    a.add_argument("--state-dir", required=True)
    a.add_argument("--policy-db", required=True)
    a.add_argument("--progress", required=True)
    a.add_argument("--deadline-s", type=float, default=600.0)
    for q in (a, sub.add_parser("worker")):
        q.add_argument("--train-steps", type=int, required=True)
        q.add_argument("--pace-file", required=True)
        q.add_argument("--pace-s", type=float, default=0.05)
    args = p.parse_args()
    return anchor(args) if args.cmd == "anchor" else worker(args)


if __name__ == "__main__":
    sys.exit(main())
