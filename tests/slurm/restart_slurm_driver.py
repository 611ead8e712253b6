"""One coordinator run for tests/slurm/test_coordinator_restart_slurm.py: the real run_job
(SQLite record, control channel) over the real SlurmBackend of an anchor job the test
submitted, stand-in workers (bench/fake_worker.py) as srun steps, a policy that grows from 1
node to 2 with a member allocation. Every request and release the backend receives is
appended to ``<dir>/actions.jsonl`` with the run (this process) and whether a member was
submitted for it (flushed at once: a SIGKILLed coordinator's calls are all there).

    python restart_slurm_driver.py <dir> <job id> <anchor job id>
"""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from slurm_etc.alloc.chooser import Hardware, TrainingJob
from slurm_etc.coordinator.backend import ReleaseDevices, RequestNodes
from slurm_etc.coordinator.job import JobSpec
from slurm_etc.coordinator.run import run_job
from slurm_etc.plan import load_model
from slurm_etc.policy.rules import EffectivePolicy
from slurm_etc.slurm.backend import SlurmBackend
from slurm_etc.testing.hooks import coordinator_crash_from_env

FAKE = Path(__file__).resolve().parents[2] / "bench" / "fake_worker.py"


class CountingBackend(SlurmBackend):
    def __init__(self, log: Path, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.log = log

    def _note(self, entry: dict) -> None:
        with self.log.open("a") as f:
            f.write(json.dumps({**entry, "run": os.getpid()}) + "\n")

    def request(self, action: RequestNodes) -> None:
        known = action.key in self.members
        super().request(action)
        self._note({"request": action.key, "nodes": action.nodes,
                    "submitted": None if known else self.members.get(action.key)})

    def release(self, action: ReleaseDevices) -> None:
        self._note({"release": sorted(str(d) for d in action.devices)})
        super().release(action)


def main() -> int:
    out, job, anchor = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    backend = CountingBackend(out / "actions.jsonl", out / "run", anchor_job=anchor,
                              poll_interval_s=0.5, log_dir=out / "steps")
    spec = JobSpec(job, "restart", (sys.executable, str(FAKE)),
                   TrainingJob(load_model("small"), 16, 1, True),
                   EffectivePolicy(grow=True, max_nodes=2), Hardware(gpus_per_node=2),
                   worker_timeout_s=60.0,
                   env={"FAKE_STEPS": os.environ.get("FAKE_STEPS", "400"),
                        "FAKE_STEP_S": "0.1", "SLURM_ETC_JOB": job})
    result = run_job(spec, backend, backend.topology, backend_name="slurm",
                     db=str(out / "job.db"), state_dir=str(out / "state"),
                     secret_dir=out / "keys", deadline_s=400,
                     crash=coordinator_crash_from_env())
    print(json.dumps({"state": result["state"], "generation": result["generation"]}))
    return 0 if result["state"] == "finished" else 1


if __name__ == "__main__":
    sys.exit(main())
