"""Workers forked from the preloader against workers that start cold, side by side: the same
job (the demo's preset worker, `tiny`, 2 processes, a node of 2 granted at step 4, training
ended 30 settled steps later) on the local backend, once with ``preload=False`` and once
with ``preload=True``, alternating, ``--repeat`` times each.

Figures: the job's wall time (coordinator start to end), the joiners' warm-up the old layout
trained through (the grow's preparation, from the record) and the grow's pause.

    OMP_NUM_THREADS=1 .venv/bin/python bench/local_preload.py [--repeat 2] [--json]
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

from slurm_etc.coordinator.run import run_job
from slurm_etc.local.backend import LocalBackend
from slurm_etc.local.demo import demo_spec
from slurm_etc.local.script import script_from_dict
from slurm_etc.plan.model import PRESETS
from slurm_etc.store import jobs as record
from slurm_etc.store.db import open_store_readonly


def one(preload: bool, tmp: Path) -> dict:
    script = script_from_dict({"nodes": 2, "gpus_per_node": 2, "initial_nodes": 1,
                               "settled_steps": True, "end_step": 34,
                               "events": [{"at_step": 4, "grant": ["n1"]}]}, "<bench>")
    backend = LocalBackend(script, log_dir=tmp / "workers", preload=preload)
    job = f"preload-{int(preload)}"
    t0 = time.perf_counter()
    out = run_job(demo_spec(job, PRESETS["tiny"], 5000), backend, backend.topology,
                  db=str(tmp / "job.db"), state_dir=str(tmp / "state"), deadline_s=900)
    wall = time.perf_counter() - t0
    store = open_store_readonly(tmp / "job.db")
    try:
        detail = record.job_detail(store, job)
    finally:
        store.close()
    assert out["state"] == "finished" and detail is not None, out
    (grow,) = [m for m in detail.migrations if m.outcome == "committed"]
    return {"preload": preload, "wall_s": wall, "steps": out["step"],
            "trained_through_s": grow.preparation_seconds, "pause_s": grow.pause_seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    runs = []
    for i in range(args.repeat):
        for preload in (False, True):
            with tempfile.TemporaryDirectory() as tmp:
                runs.append(one(preload, Path(tmp)))
            r = runs[-1]
            print(f"run {i + 1} {'preloaded' if preload else 'cold     '}: job {r['wall_s']:.1f} "
                  f"s, warm-up trained through {r['trained_through_s']:.2f} s, pause "
                  f"{r['pause_s']:.3f} s, {r['steps']} steps", flush=True)
    med = {p: {k: statistics.median(r[k] for r in runs if r["preload"] is p)
               for k in ("wall_s", "trained_through_s", "pause_s")} for p in (False, True)}
    print(f"median: job {med[False]['wall_s']:.1f} s cold against {med[True]['wall_s']:.1f} s "
          f"preloaded ({med[False]['wall_s'] / med[True]['wall_s']:.1f}x); warm-up trained "
          f"through {med[False]['trained_through_s']:.1f} s against "
          f"{med[True]['trained_through_s']:.1f} s")
    if args.json:
        print(json.dumps({"runs": runs}))


if __name__ == "__main__":
    main()
