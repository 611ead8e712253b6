"""One coordinator run for tests/dist/test_coordinator_restart.py: the real run_job (SQLite
record, control channel, local backend) with stand-in workers (bench/fake_worker.py) on a
2-node simulated cluster whose policy grows from 1 node to 2. Every request and release the
backend receives is appended to ``<dir>/actions.jsonl`` (flushed at once, so a SIGKILLed
coordinator's calls are all there).

    python restart_driver.py <dir> <job id>
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
from slurm_etc.local.backend import LocalBackend
from slurm_etc.local.script import script_from_dict
from slurm_etc.plan import load_model
from slurm_etc.policy.rules import EffectivePolicy
from slurm_etc.testing.hooks import coordinator_crash_from_env

FAKE = Path(__file__).resolve().parents[2] / "bench" / "fake_worker.py"


class CountingBackend(LocalBackend):
    def __init__(self, log: Path, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.log = log

    def _note(self, entry: dict) -> None:
        with self.log.open("a") as f:  # "run": which coordinator process called
            f.write(json.dumps({**entry, "run": os.getpid()}) + "\n")

    def request(self, action: RequestNodes) -> None:
        self._note({"request": action.key, "nodes": action.nodes})
        super().request(action)

    def release(self, action: ReleaseDevices) -> None:
        self._note({"release": sorted(str(d) for d in action.devices)})
        super().release(action)


def main() -> int:
    out, job = Path(sys.argv[1]), sys.argv[2]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    script = script_from_dict({"nodes": 2, "gpus_per_node": 2, "initial_nodes": 1,
                               "grant_requests": True, "events": []})
    spec = JobSpec(job, "restart", (sys.executable, str(FAKE)),
                   TrainingJob(load_model("small"), 16, 1, True),
                   EffectivePolicy(grow=True, max_nodes=2), Hardware(gpus_per_node=2),
                   worker_timeout_s=30.0,
                   env={"FAKE_STEPS": "100", "FAKE_STEP_S": "0.05", "SLURM_ETC_JOB": job})
    backend = CountingBackend(out / "actions.jsonl", script, log_dir=out / "workers")
    result = run_job(spec, backend, backend.topology, db=str(out / "job.db"),
                     state_dir=str(out / "state"), secret_dir=out / "keys", deadline_s=120,
                     crash=coordinator_crash_from_env())
    print(json.dumps({"state": result["state"], "generation": result["generation"]}))
    return 0 if result["state"] == "finished" else 1


if __name__ == "__main__":
    sys.exit(main())
