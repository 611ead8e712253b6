"""The example is a worker as shipped (the wrapper's default TRAIN_CMD): started by the
coordinator it joins the job and trains through a resize, with the coordinator planning from
the model file that describes it (examples/train_gpt.model.json: the same plan digest on
both sides, else the grow would abort). The joiner imports megatron-core for tens of seconds
on a busy 2-core machine while the old layout trains on: the workers' budget has steps
enough for it on any machine, and the events script ends training 10 steps after the grow
(its end_step, counted in steps trained while no resize was in flight)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train_gpt.py"
MODEL = REPO / "examples" / "train_gpt.model.json"


def test_example_started_by_the_coordinator_joins_and_grows(tmp_path):
    events = tmp_path / "events.json"
    events.write_text(json.dumps({"nodes": 2, "gpus_per_node": 1, "initial_nodes": 1,
                                  "settled_steps": True, "end_step": 12,
                                  "events": [{"at_step": 2, "grant": ["n1"]}]}))
    done = subprocess.run(
        [str(Path(sys.executable).with_name("slurm-etc")), "run", "--model", str(MODEL),
         "--global-batch", "16", "--micro-batch", "2", "--hardware", "cpu",
         "--events", str(events), "--db", str(tmp_path / "job.db"),
         "--state-dir", str(tmp_path / "state"), "--json", "--",
         sys.executable, str(EXAMPLE), "--train-steps", "5000"],
        capture_output=True, text=True, timeout=540, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["state"] == "finished" and 12 <= out["step"] < 5000, out
    assert "unfired_events" not in out
    assert "generation 1 committed: dp=2,tp=1,pp=1" in done.stderr, done.stderr[-3000:]
    assert "aborted" not in done.stderr and "differs" not in done.stderr
    assert f"trained to step {out['step']}" in done.stderr
