"""A worker killed (SIGKILL, by itself: ``SLURM_ETC_INJECT``) at every phase of a resize,
under the real coordinator on the local backend: real worker processes (the preset trainer,
gloo migrations, the authenticated control channel) and the job's record in a real SQLite
file.

For each phase the job must end ``finished`` at the last step, the record must hold the
resize the kill hit (``aborted`` before the commit, ``committed`` after it) and the resize
that replaced it (``committed``), and the loss of every step must equal bit for bit the
losses of megatron-core's checkpoint-restart through the same layouts at the same steps
(the oracle: :func:`slurm_etc.worker.sequence.checkpoint_losses`, which shares no code with
the in-memory migration): nothing of the state was lost or corrupted.

The cluster is the smallest that has every phase: one node of two devices training
dp=2, a second node granted at step 2 (the resize the kill hits: dp=2,tp=1 -> dp=2,tp=2; old
ranks send, joiners receive).
"""
from __future__ import annotations

import dataclasses
import signal
import sys

import pytest

from slurm_etc.coordinator.run import run_job
from slurm_etc.local.backend import LocalBackend
from slurm_etc.local.demo import demo_spec
from slurm_etc.local.script import script_from_dict
from slurm_etc.migrate.faults import KILL_PHASES
from slurm_etc.plan import ParallelConfig
from slurm_etc.plan.model import PRESETS
from slurm_etc.store import jobs as record
from slurm_etc.store.db import open_store_readonly
from slurm_etc.worker.sequence import ResizeSequence, checkpoint_losses

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]

# the workers' budget (their learning-rate schedule's length); training ends at END_STEP,
# counted in steps trained outside resizes (``settled_steps``): tiny's steps take ~50 ms
# here, and the old layout trains on while the grow is ordered and its joiners start (once,
# under load, it trained all of a fixed 20 steps first and no resize ran)
BUDGET = 60
END_STEP = 10
GLOBAL_BATCH = 8


def _script():
    return script_from_dict({
        "nodes": 3, "gpus_per_node": 2, "initial_nodes": 1, "settled_steps": True,
        "end_step": END_STEP,
        "events": [{"at_step": 2, "grant": ["n1", "n2"], "reason": "two idle nodes"}]}, "<inject>")


def run_with_kill(tmp_path, where: str, worker: str | None = None
                  ) -> tuple[dict, object, dict[int, float]]:
    model = PRESETS["tiny"]
    job_id = f"inject-{where}"
    seen: list[dict] = []
    backend = LocalBackend(_script(), log_dir=tmp_path / "workers", preload=True)
    # resizes at fixed steps: ordered at once and prepared where agreed (a run this
    # short would end inside the joiners' warm-up)
    spec = dataclasses.replace(demo_spec(job_id, model, BUDGET, GLOBAL_BATCH, inject=where),
                               order_after_joined=False,
                               prepare_while_training=False)
    if worker is not None:
        spec = dataclasses.replace(spec, argv=(sys.executable, "-m", worker, *spec.argv[3:]))
    out = run_job(spec, backend, backend.topology, db=str(tmp_path / "job.db"),
                  state_dir=str(tmp_path / "state"), progress=seen.append, deadline_s=600)
    store = open_store_readonly(tmp_path / "job.db")
    try:
        detail = record.job_detail(store, job_id)
    finally:
        store.close()
    return out, detail, {p["step"]: p["loss"] for p in seen}


# in-vote (a death inside the commit vote) is proven at the executor, with real processes and
# the store's one decision: tests/dist/test_inject_vote.py (a run here would cost CI ~1.5 min)
@pytest.mark.parametrize("where", [p for p in KILL_PHASES if p != "in-vote"])
def test_worker_killed_at_phase(tmp_path, where):
    out, detail, losses = run_with_kill(tmp_path, where)
    assert out["state"] == "finished", out
    assert detail is not None and detail.job.state == "finished"
    # the kill happened: one worker exited by SIGKILL, recorded
    exits = [e for e in detail.events if e.kind == "worker-exit"]
    assert len(exits) == 1, [e.payload for e in detail.events]
    assert f"exited with {-signal.SIGKILL}" in exits[0].payload["summary"]
    migrations = sorted(detail.migrations, key=lambda m: m.id)
    hit, replacement = migrations[0], migrations[1]
    assert hit.outcome == ("committed" if where == "after-commit" else "aborted"), hit
    assert replacement.outcome == "committed"
    assert all(m.outcome == "committed" for m in migrations[1:])
    if hit.outcome == "aborted":
        assert hit.error
    # the kill happened where it was asked for
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "workers").iterdir())
    assert logs.count(f"killing itself (SIGKILL) at {where}") == 1
    assert END_STEP <= out["step"] < BUDGET
    assert sorted(losses) == list(range(1, out["step"] + 1))
    assert losses == reference_losses(detail, out["step"])


def reference_losses(detail, last: int) -> dict[int, float]:
    """Checkpoint-restart through the generations that trained, ended at the same steps
    (``last``: the job's), on the workers' learning-rate schedule."""
    gens = sorted(detail.generations, key=lambda g: g.number)
    assert gens[-1].last_step == last
    trained: list = []
    for g in gens:
        if not trained or g.last_step > trained[-1][1]:
            trained.append((ParallelConfig.parse(g.layout), g.last_step))
    assert len(trained) >= 2
    key = tuple(trained)
    if key not in _REFERENCES:  # cases whose layouts switched at the same steps share one
        seq = ResizeSequence(PRESETS["tiny"], tuple(c for c, _ in trained), steps=1,
                             global_batch=GLOBAL_BATCH, ends=tuple(e for _, e in trained),
                             total_steps=BUDGET)
        _REFERENCES[key] = {s: r["loss"] for s, r in checkpoint_losses(seq).items()}
    return _REFERENCES[key]


_REFERENCES: dict[tuple, dict[int, float]] = {}


def test_planted_corrupt_held_state_is_caught(tmp_path):
    """The comparison above catches a bug in the after-commit path: the held shards
    perturbed (tests/dist/inject_planted_worker.py) -> the job still finishes, the losses
    differ from checkpoint-restart."""
    out, detail, losses = run_with_kill(tmp_path, "after-commit",
                                        worker="tests.dist.inject_planted_worker")
    assert out["state"] == "finished", out
    reference = reference_losses(detail, out["step"])
    assert sorted(losses) == sorted(reference)
    assert losses != reference
    first = min(s for s in losses if losses[s] != reference[s])
    held_from = max(g.last_step for g in detail.generations if g.number == 1)
    assert first == held_from + 1  # the first step trained on the held state
