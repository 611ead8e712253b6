"""`slurm-etc run` without --model (and without --global-batch) on a training script of the
user's own (tests/workers/own_gpt.py: no preset, 2 layers, hidden 96, rotary, untied): the
first layout is one worker, the coordinator plans with the model and batch its workers say,
and the job grows dp=1 -> dp=2 with the workers' plans matching the coordinator's (no
abort). Given a --model that differs, the job stops at once, before any resize, with one
line naming the first difference."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "workers" / "own_gpt.py"
END_AT, BUDGET = 12, 5000


def _run(tmp_path: Path, *options: str, steps: int) -> tuple[subprocess.CompletedProcess,
                                                                float]:
    """``steps``: the workers' budget; the events script ends training 10 steps after the
    grow (its end_step, counted while no resize is in flight)."""
    events = tmp_path / "events.json"
    events.write_text(json.dumps({"nodes": 2, "gpus_per_node": 1, "initial_nodes": 1,
                                  "settled_steps": True, "end_step": END_AT,
                                  "events": [{"at_step": 2, "grant": ["n1"]}]}))
    t0 = time.monotonic()
    done = subprocess.run(
        [str(Path(sys.executable).with_name("slurm-etc")), "run", *options,
         "--hardware", "cpu", "--events", str(events), "--db", str(tmp_path / "job.db"),
         "--state-dir", str(tmp_path / "state"), "--json", "--",
         sys.executable, str(SCRIPT), "--train-steps", str(steps)],
        capture_output=True, text=True, timeout=540, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    return done, time.monotonic() - t0


def test_own_script_without_model_plans_with_what_its_workers_say_and_grows(tmp_path):
    # steps enough for the old layout to train through the joiner's warm-up (a cold import
    # of torch and megatron-core: seconds) before the grow is ordered, on any machine
    done, _wall = _run(tmp_path, steps=BUDGET)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["state"] == "finished" and END_AT <= out["step"] < BUDGET, out
    assert "unfired_events" not in out
    err = done.stderr
    assert "generation 0: dp=1,tp=1,pp=1 on vranks [0]" in err, err[-3000:]
    assert ("planning with the model of vrank 0: 2 layers, hidden 96, 6 heads (6 query "
            "groups), ffn 192, vocab 128, seq 32, fp32; global batch 8, micro batch 2") in err
    assert "generation 1 committed: dp=2,tp=1,pp=1" in err, err[-3000:]
    assert "aborted" not in err and "differs" not in err
    assert f"trained to step {out['step']}" in err


def test_own_script_with_a_model_that_differs_stops_at_once_in_one_line(tmp_path):
    done, wall = _run(tmp_path, "--model", "tiny", "--global-batch", "8", steps=40)
    assert done.returncode == 1, done.stderr[-3000:]
    line = ("the model differs: num_layers: 2 in vrank 0's training script, 4 in "
            "--model tiny")
    stops = [ln for ln in done.stderr.splitlines() if "stops:" in ln]
    assert len(stops) == 1 and stops[0].endswith(line), done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert "generation 1" not in done.stderr  # no resize was ordered
    assert json.loads(done.stdout.strip().splitlines()[-1])["state"] == "failed"
    print(f"mismatch found and the job ended {wall:.1f} s after slurm-etc run started")
    assert wall < 120
