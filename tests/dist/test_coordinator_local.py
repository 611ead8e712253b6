"""The coordinator end to end on the local backend: a scripted grant, a preemption with
grace and a node loss without notice, on real worker processes (the preset trainer over the
authenticated control channel, gloo migrations), with the job's record in a real SQLite file.

After every resize training goes on with exactly the losses of megatron-core's
checkpoint-restart through the same layouts at the same steps (the worker issue's proof,
here for the coordinator's own decisions), and the record holds every event, generation and
migration the script implies.
"""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from dataclasses import replace

import pytest

from slurm_etc.coordinator import reconcile
from slurm_etc.coordinator.pause import PauseTracker
from slurm_etc.coordinator.run import run_job
from slurm_etc.local.backend import LocalBackend
from slurm_etc.local.demo import demo_script, demo_spec
from slurm_etc.plan import ParallelConfig
from slurm_etc.plan.model import PRESETS
from slurm_etc.protocol.messages import Resized, Resumed
from slurm_etc.store import jobs as record
from slurm_etc.store.db import open_store_readonly
from slurm_etc.worker.sequence import ResizeSequence, checkpoint_losses

pytestmark = [pytest.mark.dist, pytest.mark.timeout(1800)]

# the events at 4, 8, 12 and 16 and the end at STEPS count the steps trained outside resizes
# (settled_steps), whatever the old layouts train while a resize starts; BUDGET: the workers'
# (their learning-rate schedule's length)
STEPS, BUDGET = 24, 60


def test_grant_preemption_and_loss_keep_training_exactly(tmp_path, monkeypatch):
    # a planned resize's order to one rank of the old layout (reconcile.first_told; 4 by
    # default, so every rank of these small layouts): the others learn it from the step's
    # collectives, the path of a large job's layouts
    monkeypatch.setattr(reconcile, "ORDER_COPIES", 1)
    told: list[tuple[int, int]] = []  # (ranks of the old layout told, its live ranks)
    first_told = reconcile.first_told

    def counted(resize):
        chosen = first_told(resize)
        told.append((len(chosen), len(resize.stayers)))
        return chosen

    monkeypatch.setattr(reconcile, "first_told", counted)
    # the Resumed reports the coordinator reads (worker/reporting.py: the widest gap's and
    # stall's ranks report for the layout)
    resumed: list[Resumed] = []
    add = PauseTracker.add

    def heard(tracker, report):
        resumed.append(report)
        return add(tracker, report)

    monkeypatch.setattr(PauseTracker, "add", heard)
    # the Resized answers it reads, in a resize or late (the migration group's proposer
    # answers for all where the commit decision's share reached every rank)
    answers: list[Resized] = []
    answered, late_answer = reconcile.answered, reconcile.late_answer

    def answer(fl, vrank, report):
        answers.append(report)
        return answered(fl, vrank, report)

    def late(waiting, report):
        answers.append(report)
        return late_answer(waiting, report)

    monkeypatch.setattr(reconcile, "answered", answer)
    monkeypatch.setattr(reconcile, "late_answer", late)
    model = PRESETS["tiny"]
    job_id = "e2e-local"
    seen: list[dict] = []
    script = demo_script(STEPS, settled_steps=True, end=True)
    backend = LocalBackend(script, log_dir=tmp_path / "workers", preload=True)
    # resizes at fixed steps: ordered at once and prepared where agreed (a run this short
    # would end inside the joiners' warm-up; tests/dist/test_zero_stall_local.py holds the
    # zero-stall path to checkpoint-restart)
    spec = replace(demo_spec(job_id, model, BUDGET), order_after_joined=False,
                   prepare_while_training=False)
    out = run_job(spec, backend, backend.topology,
                  db=str(tmp_path / "job.db"), state_dir=str(tmp_path / "state"),
                  progress=seen.append, deadline_s=1200)
    assert out["state"] == "finished", out
    assert STEPS <= out["step"] < BUDGET
    # the grow and the preemption told one of their old layout's ranks (the loss every one)
    assert sum(1 for n, live in told if n == 1 < live) >= 2, told
    store = open_store_readonly(tmp_path / "job.db")
    try:
        detail = record.job_detail(store, job_id)
    finally:
        store.close()
    assert detail is not None and detail.job.state == "finished"

    # every scripted event (and the anchor's grant) recorded once, and handled
    kinds = Counter(e.kind for e in detail.events)
    scripted = Counter({"grant": 1})
    for ev in script.events:
        scripted[{"grant": "grant", "preempt": "preempt-notice", "lose": "loss"}[ev.kind]] += 1
    assert {k: kinds[k] for k in scripted} == dict(scripted), kinds
    assert all(e.handled_at is not None for e in detail.events if e.kind in scripted)

    # start, grow, shrink on notice, grow, shrink on loss: five generations, four migrations
    gens = sorted(detail.generations, key=lambda g: g.number)
    assert [g.world_size for g in gens] == [2, 4, 2, 4, 2]
    assert [m.outcome for m in detail.migrations] == ["committed"] * 4
    for m in detail.migrations:
        assert m.moved_bytes >= m.lower_bound_bytes
        assert m.pause_seconds is not None and m.pause_seconds > 0
        assert m.pause_measured and m.pause_processes == gens[m.to_generation].world_size, m
        # one or two reports a resize (its widest gap's rank, its widest stall's), for all
        got = [r for r in resumed if r.generation == m.to_generation]
        assert 1 <= len(got) <= 2, got
        assert [r.widest_of for r in got if r.widest_of] == [gens[m.to_generation].world_size]
        assert [r.stall_of for r in got if r.stall_of] == [gens[m.to_generation].world_size]
        # one answer for the whole group, its longest data phase the one recorded; the
        # loss's too (a replica covers it: nothing is rebuilt, tests/dist/test_node_lost*
        # hold a rebuild's answers)
        said = [r for r in answers if r.generation == m.to_generation]
        assert [(r.outcome, r.for_group) for r in said] == [("committed", True)], said
        assert said[0].data_seconds == m.data_seconds > 0, (said, m)
    assert gens[-1].last_step == out["step"]
    assert out["reaction_s"] and max(out["reaction_s"]) < 5.0

    # what a user sees: `slurm-etc status --json` in a process of its own
    shown = subprocess.run(
        [sys.executable, "-c", "from slurm_etc.cli.main import main; main()", "status",
         job_id, "--db", str(tmp_path / "job.db"), "--json"],
        capture_output=True, text=True, timeout=120, check=True)
    (job,) = json.loads(shown.stdout)["jobs"]
    assert job["job_id"] == job_id and job["state"] == "finished"
    assert len(job["generations"]) == 5
    committed = [m for m in job["migrations"] if m["outcome"] == "committed"]
    assert len(committed) == 4
    assert all(m["moved_bytes"] >= m["lower_bound_bytes"] for m in committed)
    assert {e["kind"] for e in job["events"]} >= {"grant", "preempt-notice", "loss"}

    # the losses of the coordinated run equal checkpoint-restart through the same layouts,
    # resized at the same steps
    configs = tuple(ParallelConfig.parse(g.layout) for g in gens)
    ends = tuple(g.last_step for g in gens)
    seq = ResizeSequence(model, configs, steps=1, global_batch=8, ends=ends,
                         total_steps=BUDGET)
    reference = checkpoint_losses(seq)
    losses = {p["step"]: p["loss"] for p in seen}
    assert sorted(losses) == list(range(1, out["step"] + 1))
    assert losses == {s: r["loss"] for s, r in reference.items()}
