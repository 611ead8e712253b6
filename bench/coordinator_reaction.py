"""Coordinator reaction time: from a preemption notice reaching the coordinator to the
resize order leaving it (event recorded, policy decision, vranks, planning with the real
planner, migration record, order sent), over many notices.

The coordinator, its store (SQLite), the control channel and the local backend are the real
ones; the workers are stand-ins (bench/fake_worker.py) that speak the protocol and answer
resizes at once, so the figure is the coordinator's own. Each cycle grants a fresh node
(grow) and then preempts it (shrink with grace).

    .venv/bin/python bench/coordinator_reaction.py [--cycles 20] [--model llama-7b]
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
from pathlib import Path

from slurm_etc.alloc.chooser import Hardware, TrainingJob
from slurm_etc.coordinator.job import JobSpec
from slurm_etc.coordinator.run import run_job
from slurm_etc.local.backend import LocalBackend
from slurm_etc.local.script import script_from_dict
from slurm_etc.plan import load_model
from slurm_etc.policy.rules import EffectivePolicy


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cycles", type=int, default=20)
    p.add_argument("--model", default="llama-7b")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=512)
    p.add_argument("--json", action="store_true")
    p.add_argument("-v", action="store_true", help="log the coordinator")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO if "-v" in sys.argv else logging.WARNING)
    events = []
    for i in range(args.cycles):
        events.append({"at_step": 20 * i + 5, "grant": [f"n{i + 1}"]})
        events.append({"at_step": 20 * i + 15, "preempt": [f"n{i + 1}"], "grace_s": 60})
    script = script_from_dict({"nodes": args.cycles + 1, "gpus_per_node": args.gpus_per_node,
                               "initial_nodes": 1, "events": events})
    fake = str(Path(__file__).with_name("fake_worker.py"))
    model = load_model(args.model)
    spec = JobSpec("reaction", "bench", (sys.executable, fake),
                   TrainingJob(model, args.global_batch, 1, True),
                   EffectivePolicy(grow=False), Hardware(gpus_per_node=args.gpus_per_node),
                   worker_timeout_s=60.0)
    with tempfile.TemporaryDirectory(prefix="etc-reaction-") as tmp:
        logs = Path("/tmp/etc-reaction-workers") if args.v else Path(tmp) / "workers"
        backend = LocalBackend(script, log_dir=logs)
        out = run_job(spec, backend, backend.topology, db=f"{tmp}/job.db",
                      state_dir=f"{tmp}/state", deadline_s=60.0 + 8.0 * args.cycles,
                      secret_dir=Path(tmp) / "secrets")
    r = sorted(out["reaction_s"])
    summary = {"model": args.model, "gpus_per_node": args.gpus_per_node,
               "notices": len(r), "median_s": statistics.median(r) if r else None,
               "p90_s": r[int(0.9 * (len(r) - 1))] if r else None, "max_s": max(r, default=None),
               "generations": out["generation"]}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{summary['notices']} preemption notices, {args.model} on nodes of "
              f"{args.gpus_per_node}: reaction median {summary['median_s']:.3f} s, p90 "
              f"{summary['p90_s']:.3f} s, max {summary['max_s']:.3f} s "
              f"({out['generation']} generations)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
