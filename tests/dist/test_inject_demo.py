"""The demo's job (``slurm_etc.local.demo.demo_spec``: the preset worker, the local
backend, the coordinator, its SQLite record, ``SLURM_ETC_INJECT``) with a worker killed
before it sends, where the retried resize lands on the two new devices only and the next
resize brings the anchor's vrank 0 back while its old process, which left the job at the
retry's commit, is still exiting. This hung until the worker timeout (the backend took the
launch of vrank 0 for that exiting process and started nothing; the resize waited for a
joiner that never came): see ``Coordinator.leaving``.

Checked: the job ends ``finished`` at the last step, vrank 0 was launched again after it
left, ``slurm-etc status --json`` shows the aborted migration and the committed one that
replaced it, and every generation's last loss equals bit for bit megatron-core's
checkpoint-restart through the same layouts ending at the same steps (the oracle shares no
code with the in-memory migration).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from slurm_etc.coordinator.run import run_job
from slurm_etc.local.backend import LocalBackend
from slurm_etc.local.demo import demo_spec
from slurm_etc.local.script import script_from_dict
from slurm_etc.plan import ParallelConfig
from slurm_etc.plan.model import PRESETS
from slurm_etc.worker.sequence import ResizeSequence, checkpoint_losses

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

# the workers' budget (their learning-rate schedule's length); the events and the end at
# END_STEP count the steps trained outside resizes (``settled_steps``): tiny's steps take
# ~40 ms here and the old layout trains on while the grow is ordered, fails and is retried
# (with a fixed 12 steps the retry once landed at step 10, leaving the shrunk layout nothing)
BUDGET = 60
END_STEP = 8
SLURM_ETC = str(Path(sys.executable).parent / "slurm-etc")
GLOBAL_BATCH = 8


def test_retry_on_new_devices_then_vrank_back(tmp_path):
    script = script_from_dict({
        "nodes": 3, "gpus_per_node": 2, "initial_nodes": 1, "grace_s": 120,
        "settled_steps": True, "end_step": END_STEP,
        "events": [{"at_step": 2, "grant": ["n1"], "reason": "an idle node"},
                   {"at_step": 4, "preempt": ["n1"], "grace_s": 120,
                    "reason": "a higher-priority job"}]}, "<inject-demo>")
    job_id = "inject-demo"
    backend = LocalBackend(script, log_dir=tmp_path / "workers", preload=True)
    # resizes at fixed steps: ordered at once and prepared where agreed (a run this
    # short would end inside the joiners' warm-up)
    spec = replace(demo_spec(job_id, PRESETS["tiny"], BUDGET, GLOBAL_BATCH,
                             inject="before-send"), order_after_joined=False,
                   prepare_while_training=False)
    out = run_job(spec, backend, backend.topology, db=str(tmp_path / "job.db"),
                  state_dir=str(tmp_path / "state"), deadline_s=400)
    assert out["state"] == "finished" and END_STEP <= out["step"] < BUDGET, out
    logs = {p.name: p.read_text(errors="replace") for p in (tmp_path / "workers").iterdir()}
    assert sum(t.count("killing itself (SIGKILL) at before-send") for t in logs.values()) == 1
    # the configuration that hung: vrank 0 left (retry on the new node) and came back
    assert any(n.startswith("gen") and n.endswith("-vrank0.log") and n != "gen0-vrank0.log"
               for n in logs), sorted(logs)

    got = subprocess.run([SLURM_ETC, "status", job_id,
                          "--db", str(tmp_path / "job.db"), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    job = json.loads(got.stdout)["jobs"][0]
    assert job["state"] == "finished"
    migrations = sorted(job["migrations"], key=lambda m: m["id"])
    assert migrations[0]["outcome"] == "aborted" and migrations[0]["error"]
    assert migrations[1]["outcome"] == "committed"
    assert migrations[1]["from_generation"] == migrations[0]["from_generation"]
    assert all(m["outcome"] == "committed" for m in migrations[1:])
    # the human view of the same record renders (the gloo error quotes '[/...]')
    view = subprocess.run([SLURM_ETC, "status", job_id,
                           "--db", str(tmp_path / "job.db")],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "400"})
    assert view.returncode == 0 and "aborted" in view.stdout, view.stderr

    gens = sorted(job["generations"], key=lambda g: g["number"])
    trained = []
    for g in gens:
        if g["last_step"] is not None and (not trained or g["last_step"] > trained[-1][1]):
            trained.append((ParallelConfig.parse(g["layout"]), g["last_step"], g["last_loss"]))
    assert trained[-1][1] == out["step"] and len(trained) >= 3
    # the reference switches layouts where the job did (a resize to the same configuration
    # on other devices is no switch for it); every generation's last loss is compared
    switches: list = []
    for c, e, _ in trained:
        if switches and switches[-1][0] == c:
            switches[-1] = (c, e)
        else:
            switches.append((c, e))
    seq = ResizeSequence(PRESETS["tiny"], tuple(c for c, _ in switches), steps=1,
                         global_batch=GLOBAL_BATCH, ends=tuple(e for _, e in switches),
                         total_steps=BUDGET)
    reference = checkpoint_losses(seq)
    assert [loss for _, _, loss in trained] == [reference[e]["loss"] for _, e, _ in trained]
