"""One coordinator run for the reattach test of tests/dist/test_coordinator_restart.py: the
real run_job (SQLite record, control channel, rendezvous store, local backend) with the real
preset trainer (megatron-core ``tiny``) on one simulated node of two devices. Every step the
coordinator hears of is appended to ``<dir>/progress.jsonl`` with this process's pid (loss as
JSON's repr of the float: bit for bit); the workers log to ``<dir>/workers`` (appended, so
a reattached worker's lines follow its first ones).

    python reattach_driver.py <dir> <job id> <train steps> [<grow at step> [preload] [forget]]

With ``<grow at step>`` (> 0) the cluster has a second node of two devices, granted by the
script at that step (the job grows from 2 to 4 workers); ``preload``: the workers fork from
the preloader, as under ``slurm-etc run``; ``forget`` plants a bug: the backend does not
take up the cluster state kept by the coordinator before it (what it was granted).
"""
from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path

from slurm_etc.coordinator.run import run_job
from slurm_etc.local.backend import LocalBackend
from slurm_etc.local.demo import demo_spec
from slurm_etc.local.script import script_from_dict, script_from_options
from slurm_etc.plan.model import PRESETS
from slurm_etc.testing.hooks import coordinator_crash_from_env


class Forgetful(LocalBackend):
    """The planted bug: a restarted coordinator's cluster starts afresh."""

    def keep_state(self, path: Path, *, resume: bool) -> None:
        super().keep_state(path, resume=False)


def main() -> int:
    out, job, steps = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    grow_at = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    preload, forget = "preload" in sys.argv[5:], "forget" in sys.argv[5:]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(message)s")
    spec = demo_spec(job, PRESETS["tiny"], steps)
    spec = replace(spec, env={**spec.env, "SLURM_ETC_JOB": job})
    script = (script_from_dict({"nodes": 2, "gpus_per_node": 2, "initial_nodes": 1,
                                "events": [{"at_step": grow_at, "grant": 1}]})
              if grow_at > 0 else script_from_options(1, 2))
    backend = (Forgetful if forget else LocalBackend)(script, log_dir=out / "workers",
                                                      preload=preload)
    seen = (out / "progress.jsonl").open("a", buffering=1)

    def progress(p: dict) -> None:
        seen.write(json.dumps({**p, "run": os.getpid()}) + "\n")

    result = run_job(spec, backend, backend.topology, db=str(out / "job.db"),
                     state_dir=str(out / "state"), secret_dir=out / "keys", deadline_s=600,
                     progress=progress, crash=coordinator_crash_from_env())
    print(json.dumps({"state": result["state"], "step": result["step"]}))
    return 0 if result["state"] == "finished" else 1


if __name__ == "__main__":
    sys.exit(main())
