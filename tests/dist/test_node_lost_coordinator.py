"""A node lost without grace, through the coordinator: real worker processes on the local
backend (its SIGKILL of a node's processes), gloo, the control channel and a real SQLite
record; no replica of the lost state.

Cluster: two one-device nodes. The job starts on n0 (the anchor), n1 is granted at step 1
and the job grows to two devices with the distributed optimizer (each device holds the only
copy of its optimizer shard, or of its pipeline stage); at step ``LOSE_AT`` n1 fails without
notice. ``slurm-etc run --peer-copy-every 2`` is what the job spec says here.

* peer copies: the coordinator orders the shrink anyway; the survivor rolls back to its
  newest peer copies, a stand-in migrates the dead rank from its copy, and training goes on.
  Oracle: megatron-core checkpoint-restart through the same layouts, switching at the step
  the job rolled back to (``checkpoint_losses``, fresh processes and dist_checkpointing,
  sharing no code with peer copies, the coordinator or the migration): every step's loss,
  LR and consumed samples of the finished run bit-equal. The lost steps the record and
  `status --json` show must be exactly the steps the old layout reported and the new one
  trained again (from the progress stream), and their rollback step a refresh step.
* a checkpoint every 2 steps instead of peer copies: the last one is loaded; same oracle.
* planted stale copies (``SLURM_ETC_PLANT_STALE_COPIES``): the same oracle fails it.
* a joiner killed after the commit, before installing, with the distributed optimizer:
  peer copies cannot rebuild it (none of a layout that never trained), the checkpoint does.
* no copies, no checkpoint: the job stops with one line naming the lost devices and the
  options that would have saved it.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from slurm_etc.coordinator.run import run_job
from slurm_etc.local.backend import LocalBackend
from slurm_etc.local.demo import demo_spec
from slurm_etc.local.script import script_from_dict
from slurm_etc.plan import ParallelConfig
from slurm_etc.plan.model import PRESETS
from slurm_etc.protocol.recovery import Recovery
from slurm_etc.store import jobs as record
from slurm_etc.store.db import open_store_readonly
from slurm_etc.worker.sequence import ResizeSequence, checkpoint_losses

pytestmark = [pytest.mark.dist, pytest.mark.timeout(1200)]

MODEL = PRESETS["tiny"]
# BUDGET: the workers' budget (their learning-rate schedule's length); the events and the end
# at END_STEP count the steps trained outside resizes (``settled_steps``): under load the old
# layout trains on while the grow's joiner starts (with a fixed 12 steps the grow once landed
# at step 11, before the loss could come)
BUDGET, END_STEP, GB, EVERY, LOSE_AT = 60, 12, 8, 2, 9


def _script(grant_at: int = 1, lose_at: int | None = LOSE_AT):
    events = [{"at_step": grant_at, "grant": ["n1"], "reason": "an idle node"}]
    if lose_at is not None:
        events.append({"at_step": lose_at, "lose": ["n1"], "reason": "node failure"})
    return script_from_dict({"nodes": 2, "gpus_per_node": 1, "initial_nodes": 1,
                             "settled_steps": True, "end_step": END_STEP,
                             "events": events}, "<lost>")


def _run(tmp_path, name: str, recovery: Recovery, env: dict | None = None,
         script=None) -> dict:
    # resizes at fixed steps: ordered at once and prepared where agreed (a run this
    # short would end inside the joiners' warm-up)
    spec = replace(demo_spec(f"lost-{name}", MODEL, BUDGET, global_batch=GB),
                   order_after_joined=False,
                   prepare_while_training=False)
    # the planted faults (env): the preset worker with its hooks set from them
    spec = replace(spec, argv=(sys.executable, "-m", "slurm_etc.testing.worker",
                               *spec.argv[3:], "--distributed-optimizer"),
                   job=replace(spec.job, distributed_optimizer=True),
                   env={**spec.env, **(env or {})}, recovery=recovery)
    seen: list[dict] = []
    backend = LocalBackend(script or _script(), log_dir=tmp_path / name / "workers",
                           preload=True)
    db = tmp_path / name / "job.db"
    out = run_job(spec, backend, backend.topology, db=str(db),
                  state_dir=str(tmp_path / name / "state"), progress=seen.append,
                  deadline_s=900)
    store = open_store_readonly(db)
    try:
        detail = record.job_detail(store, spec.job_id)
    finally:
        store.close()
    return {"out": out, "seen": seen, "detail": detail, "db": db, "job_id": spec.job_id}


def _config(layout: str) -> ParallelConfig:
    return ParallelConfig.parse(layout.replace(",dist-opt", ""), layout.endswith(",dist-opt"))


def _rollback(run: dict, source: str = "peer-copies", every: int | None = EVERY) -> dict:
    """What the record says of the loss, checked against the progress stream."""
    detail = run["detail"]
    gens = sorted(detail.generations, key=lambda g: g.number)
    assert [g.world_size for g in gens] == [1, 2, 1], gens
    two = _config(gens[1].layout)
    assert two.dp == 1 or two.distributed_optimizer  # no replica of what n1 held
    (rebuilt,) = [m for m in detail.migrations if m.to_generation == gens[2].number]
    assert rebuilt.outcome == "committed" and rebuilt.rebuilt_from == source, rebuilt
    back, last = gens[2].first_step, gens[1].last_step
    # the progress stream: the old layout reported steps back+1..last, the new one trained
    # them again; the record's span is exactly those (none if the copy was of the last step)
    by_gen: dict[int, list[int]] = {}
    for p in run["seen"]:
        by_gen.setdefault(p["generation"], []).append(p["step"])
    old_steps, new_steps = by_gen[gens[1].number], by_gen[gens[2].number]
    lost = [s for s in old_steps if s > back]
    assert lost == list(range(back + 1, last + 1)), by_gen
    assert rebuilt.lost_steps == ((back + 1, last) if lost else None), (rebuilt, by_gen)
    assert new_steps == list(range(back + 1, _end(run) + 1)), by_gen
    assert back > gens[1].first_step  # a copy/checkpoint of that layout
    assert every is None or back % every == 0
    assert last >= LOSE_AT
    return {"configs": tuple(_config(g.layout) for g in gens),
            "ends": (gens[0].last_step, back, _end(run)), "lost": rebuilt.lost_steps}


def _end(run: dict) -> int:
    """The step the job finished at (``END_STEP`` settled steps, and the steps trained
    through resizes)."""
    step = run["out"]["step"]
    assert END_STEP <= step < BUDGET, run["out"]
    return step


@pytest.fixture(scope="module")
def references():
    cache: dict = {}

    def get(configs, ends) -> dict:
        if (configs, ends) not in cache:
            seq = ResizeSequence(MODEL, configs, steps=1, global_batch=GB, ends=ends,
                                 total_steps=BUDGET)
            cache[(configs, ends)] = checkpoint_losses(seq)
        return cache[(configs, ends)]

    return get


def oracle(run: dict, reference: dict) -> list[str]:
    """Steps whose loss, LR or consumed samples differ from checkpoint-restart (the last
    report of each step: replayed steps count as trained again)."""
    final = {p["step"]: p for p in run["seen"]}
    problems = [] if sorted(final) == list(range(1, _end(run) + 1)) else [
        f"steps reported: {sorted(final)}"]
    for step, p in sorted(final.items()):
        ref = reference.get(step)
        want = ref and (ref["loss"], ref["lr"])
        if (p["loss"], p["lr"]) != want:
            problems.append(f"step {step}: {(p['loss'], p['lr'])} != checkpoint-restart {want}")
    return problems


def test_lost_node_is_rebuilt_from_peer_copies_exactly(tmp_path, references):
    run = _run(tmp_path, "copies", Recovery(peer_copy_every=EVERY))
    assert run["out"]["state"] == "finished", run["out"]
    got = _rollback(run)
    assert oracle(run, references(got["configs"], got["ends"])) == []

    # what a user sees: `slurm-etc status --json` in a process of its own
    shown = subprocess.run(
        [sys.executable, "-c", "from slurm_etc.cli.main import main; main()", "status",
         run["job_id"], "--db", str(run["db"]), "--json"],
        capture_output=True, text=True, timeout=120, check=True)
    (job,) = json.loads(shown.stdout)["jobs"]
    rebuilt = [m for m in job["migrations"] if m["rebuilt_from"] is not None]
    assert [(m["lost_steps"], m["rebuilt_from"]) for m in rebuilt] == \
        [(got["lost"] and list(got["lost"]), "peer-copies")]
    assert job["state"] == "finished"


def test_without_copies_the_last_checkpoint_is_loaded_exactly(tmp_path, references):
    """``--checkpoint-every 2`` alone: the survivor and the new layout load the last
    megatron-core checkpoint; the steps since are lost and trained again."""
    run = _run(tmp_path, "checkpoint", Recovery(peer_copy_every=0, checkpoint_every=EVERY,
                                                checkpoint_dir=str(tmp_path / "ckpt")))
    assert run["out"]["state"] == "finished", run["out"]
    got = _rollback(run, "checkpoint")
    assert oracle(run, references(got["configs"], got["ends"])) == []


def test_stale_peer_copies_are_caught(tmp_path, references):
    run = _run(tmp_path, "stale", Recovery(peer_copy_every=EVERY),
               env={"SLURM_ETC_PLANT_STALE_COPIES": "1"})
    assert run["out"]["state"] == "finished", run["out"]
    got = _rollback(run)
    problems = oracle(run, references(got["configs"], got["ends"]))
    # the kept steps agree; the ones trained on the stale copy do not
    steps = [int(p.split()[1].rstrip(":")) for p in problems if p.startswith("step ")]
    assert steps and min(steps) > got["ends"][1], problems


def test_after_commit_kill_without_replica_is_rebuilt_from_the_checkpoint(tmp_path):
    """The joiner of the grow (dp=1 -> dp=2, distributed optimizer) SIGKILLs itself after
    the commit, before installing: the survivor holds only its committed dp-rank-0 shards
    of a layout that never trained, so no replica and no peer copy holds the dead rank's
    optimizer shard (copies are of trained layouts, and the layout before the commit is
    gone from the survivor). With peer copies and checkpoints both on, the rebuild comes
    from the last checkpoint; training equals checkpoint-restart on one device."""
    run = _run(tmp_path, "after-commit", Recovery(peer_copy_every=EVERY,
                                                  checkpoint_every=EVERY,
                                                  checkpoint_dir=str(tmp_path / "ckpt")),
               env={"SLURM_ETC_INJECT": "after-commit@1,1"},
               script=_script(grant_at=2, lose_at=None))
    assert run["out"]["state"] == "finished", run["out"]
    detail = run["detail"]
    gens = sorted(detail.generations, key=lambda g: g.number)
    assert [g.world_size for g in gens] == [1, 2, 1], gens
    assert gens[1].first_step == gens[1].last_step  # committed, never trained
    assert _config(gens[1].layout).distributed_optimizer
    (rebuilt,) = [m for m in detail.migrations if m.to_generation == gens[2].number]
    assert rebuilt.outcome == "committed" and rebuilt.rebuilt_from == "checkpoint", rebuilt
    back = gens[2].first_step
    assert back % EVERY == 0
    want = (back + 1, gens[0].last_step) if gens[0].last_step > back else None
    assert rebuilt.lost_steps == want, (rebuilt.lost_steps, want)
    # one device before and after: checkpoint-restart there is one uninterrupted layout
    one = _config(gens[0].layout)
    assert _config(gens[2].layout) == one
    seq = ResizeSequence(MODEL, (one,), steps=_end(run), global_batch=GB,
                         total_steps=BUDGET)
    assert oracle(run, checkpoint_losses(seq)) == []


def test_by_default_a_lost_node_is_rebuilt_from_peer_copies_exactly(tmp_path, references):
    """No --peer-copy-every given (auto): the workers choose the interval in the first
    layout on two nodes (said once, in the record and `status --json`), the node lost
    without grace is rebuilt from the copies, checked against their fingerprint, and
    training equals checkpoint-restart."""
    run = _run(tmp_path, "default", Recovery())
    assert run["out"]["state"] == "finished", run["out"]
    got = _rollback(run, every=None)
    assert oracle(run, references(got["configs"], got["ends"])) == []
    shown = subprocess.run(
        [sys.executable, "-c", "from slurm_etc.cli.main import main; main()", "status",
         run["job_id"], "--db", str(run["db"]), "--json"],
        capture_output=True, text=True, timeout=120, check=True)
    (job,) = json.loads(shown.stdout)["jobs"]
    chosen = job["peer_copies"]
    assert chosen["every"] >= 1 and chosen["line"].startswith("peer copies every "), chosen
    assert chosen["copy_seconds"] > 0 and chosen["step_seconds"] > 0, chosen
    assert 0 < chosen["held_bytes"] < chosen["host_bytes"], chosen
    table = subprocess.run(
        [sys.executable, "-c", "from slurm_etc.cli.main import main; main()", "status",
         run["job_id"], "--db", str(run["db"])],
        capture_output=True, text=True, timeout=120, check=True, env={
            **__import__("os").environ, "COLUMNS": "300"})
    assert chosen["line"] in table.stdout, table.stdout


def test_a_corrupted_copy_fails_the_check_and_nothing_trains_on_it(tmp_path):
    """Planted: a byte of each shard of every peer copy changes after its fingerprint was
    taken. The
    rebuilt state does not add up to the fingerprint: the job fails with that line and no
    step is trained on the rebuilt state (Megatron-LM #5281)."""
    run = _run(tmp_path, "corrupt", Recovery(),
               env={"SLURM_ETC_PLANT_CORRUPT_COPIES": "1"})
    assert run["out"]["state"] == "failed", run["out"]
    reason = run["detail"].job.reason
    assert "\n" not in reason
    assert "does not match their fingerprint, not training on it" in reason, reason
    gens = sorted(run["detail"].generations, key=lambda g: g.number)
    assert len(gens) == 3, gens
    assert not [p for p in run["seen"] if p["generation"] == gens[2].number], run["seen"]


def test_without_copies_or_checkpoints_the_job_stops_with_one_line(tmp_path):
    run = _run(tmp_path, "none", Recovery(peer_copy_every=0))
    assert run["out"]["state"] == "failed", run["out"]
    reason = run["detail"].job.reason
    assert "\n" not in reason
    assert "n1" in reason and "cannot be rebuilt in memory" in reason, reason
    assert "--peer-copy-every" in reason, reason
    assert not [m for m in run["detail"].migrations if m.to_generation > 1], \
        run["detail"].migrations
