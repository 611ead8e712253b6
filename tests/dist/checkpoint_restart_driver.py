"""One coordinator run for tests/dist/test_restart_checkpoints.py: the real run_job (SQLite
record, control channel, local backend) with the real preset trainer on one simulated node of
two devices, a megatron-core checkpoint every EVERY steps into ``<dir>/ckpt``. Every step the
coordinator hears of is appended to ``<dir>/progress.jsonl`` with this process's pid.

    python checkpoint_restart_driver.py <dir> <job id> <train steps> <every> [orphans]

``orphans``: each worker is started behind a shell that the local backend's parent-death
signal ends, so the trainer itself is orphaned and only its silence bound (a reattach wait
of ORPHAN_WAIT_S) ends it.
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
from slurm_etc.local.script import script_from_options
from slurm_etc.plan.model import PRESETS
from slurm_etc.protocol.recovery import Recovery

ORPHAN_WAIT_S = 8.0


def main() -> int:
    out, job, steps, every = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    # resizes at fixed steps: ordered at once and prepared where agreed (a run this
    # short would end inside the joiners' warm-up)
    spec = replace(demo_spec(job, PRESETS["tiny"], steps), order_after_joined=False,
                   prepare_while_training=False)
    spec = replace(spec, recovery=Recovery(checkpoint_every=every,
                                           checkpoint_dir=str(out / "ckpt")),
                   env={**spec.env, "SLURM_ETC_JOB": job})
    if sys.argv[5:] == ["orphans"]:
        spec = replace(spec, argv=("sh", "-c", '"$@" & wait $!', "sh", *spec.argv),
                       reattach_wait_s=ORPHAN_WAIT_S)
    backend = LocalBackend(script_from_options(1, 2), log_dir=out / f"workers-{os.getpid()}")
    seen = (out / "progress.jsonl").open("a", buffering=1)

    def progress(p: dict) -> None:
        seen.write(json.dumps({**p, "run": os.getpid()}) + "\n")

    result = run_job(spec, backend, backend.topology, db=str(out / "job.db"),
                     state_dir=str(out / "state"), secret_dir=out / "keys", deadline_s=600,
                     progress=progress)
    print(json.dumps({"state": result["state"], "step": result["step"]}))
    return 0 if result["state"] == "finished" else 1


if __name__ == "__main__":
    sys.exit(main())
