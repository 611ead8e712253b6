"""A node lost without grace, where no dp replica holds what it held: real SIGKILL, real gloo.

Every process is a node (``gpus_per_node=1``). Survivors run in a pool started once per
module; the ranks that die are processes of their own that SIGKILL themselves in the middle
of a step (inside the forward pass). The test plays the coordinator: when it sees the dead
process exit by SIGKILL it tells the survivors (a key in the job's store) and they receive
the Resize naming the dead, as the coordinator's loss order would reach them.

Cases (``tiny`` preset, 8 steps, global batch 6):

* dist-opt: dp=2 with the distributed optimizer (each dp rank holds the only copy of its
  optimizer shard), peer copies every 2 steps; the rank on the other node dies during
  step 6: the survivor rolls back to step 4, rebuilds dp=1 from its own snapshot and the
  dead rank's copy, reports step 5 lost and trains it again.
* dp1-pp2: dp=1, pp=2 (every shard has one copy), same.
* node+buddy: dp=3 with the distributed optimizer; two ranks die together, one of them
  holding the other's only copy: the survivor loads the last periodic megatron-core
  checkpoint (every 2 steps) as dp=1 and reports steps 5 lost.
* stale copies (planted bug): peer copies kept one refresh stale; the oracle must fail.

Oracle: megatron-core's checkpoint-restart through the same layouts, switching where the job
says it rolled back to (``w_checkpoint_segment``: fresh model built or loaded from
dist_checkpointing, shares no code with peer copies or the migration). Every kept and
replayed step's loss, LR and consumed samples must be bit-equal to it.
"""
from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field

import pytest

from slurm_etc.plan import Layout, ParallelConfig, Topology
from slurm_etc.plan.model import PRESETS
from slurm_etc.pool.local import LocalWorkers
from slurm_etc.worker.sequence import PRELOAD, ResizeSequence, w_checkpoint_segment

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]

MODEL = PRESETS["tiny"]
STEPS, GB, SEED = 8, 6, 1234
TIMEOUT_S = 60.0
POOL = 3          # survivors' processes: vranks 0..2; the dying ones are vranks 3, 4


@dataclass(frozen=True)
class Case:
    name: str
    old: ParallelConfig
    devices: tuple[int, ...]     # old layout's vranks
    new: ParallelConfig
    new_devices: tuple[int, ...]
    die: tuple[int, ...]         # vranks that SIGKILL themselves
    die_in_step: int             # ... inside this step's forward pass
    every: int = 0               # peer copies
    ckpt_every: int = 0
    stale: bool = False
    env: dict = field(default_factory=dict)


DIST = ParallelConfig(2, 1, 1, distributed_optimizer=True)
DP1 = ParallelConfig(1, 1, 1, distributed_optimizer=True)
CASES = {
    "dist-opt": Case("dist-opt", DIST, (0, 3), DP1, (0,), (3,), 6, every=2),
    "dp1-pp2": Case("dp1-pp2", ParallelConfig(1, 1, 2), (0, 3), ParallelConfig(1, 1, 1), (0,),
                    (3,), 6, every=2),
    "node+buddy": Case("node+buddy", ParallelConfig(3, 1, 1, distributed_optimizer=True),
                       (0, 3, 4), DP1, (0,), (3, 4), 6, every=2, ckpt_every=2),
    "stale": Case("stale", DIST, (0, 3), DP1, (0,), (3,), 6, every=2, stale=True),
}


# -- the processes ------------------------------------------------------------------------

class LossControl:
    """Orders for a survivor: the Resize naming the dead, once the test saw them die."""

    def __init__(self, store, key: str, order) -> None:
        self.store, self.key, self.order, self.reports = store, key, order, []

    def poll(self):
        if self.order is not None and self.store.check([self.key]):
            order, self.order = self.order, None
            return order
        return None

    def wait(self, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (order := self.poll()) is not None:
                return order
            time.sleep(0.01)
        return None

    def report(self, message) -> None:
        self.reports.append(message)


class Silent(LossControl):
    def __init__(self) -> None:
        super().__init__(None, "", None)

    def poll(self):
        return None


def _trainer(case: Case, ckpt_dir: str | None):
    from slurm_etc.worker.gpt import preset_trainer

    t = preset_trainer(MODEL, distributed_optimizer=case.old.distributed_optimizer, seed=SEED,
                       global_batch=GB, train_steps=STEPS)
    t.peer_copy_every = case.every
    t.checkpoint_every, t.checkpoint_dir = case.ckpt_every, ckpt_dir
    return t


def _proc(case: Case, vrank: int, store, control, job: str):
    from slurm_etc.worker.trainer import WorkerProcess

    return WorkerProcess(job, vrank, store, control, layout=Layout(case.old, case.devices),
                         topology=Topology(gpus_per_node=1), keep_tp_in_node=False,
                         timeout_s=TIMEOUT_S)


def _store(port: int):
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False,
                         timeout=timedelta(seconds=TIMEOUT_S))


def dying_main(case: Case, vrank: int, port: int, job: str, ckpt_dir: str | None) -> None:
    """A rank that SIGKILLs itself inside the forward pass of ``case.die_in_step``."""
    trainer = _trainer(case, ckpt_dir)
    forward = trainer.forward_step

    def forward_or_die(data, model):
        if trainer.step + 1 == case.die_in_step:
            os.kill(os.getpid(), signal.SIGKILL)
        return forward(data, model)

    trainer.forward_step = forward_or_die
    trainer.run(_proc(case, vrank, _store(port), Silent(), job))
    raise SystemExit(f"vrank {vrank} trained to the end: it should have died")


def w_survivor(ctx, case: Case, port: int, job: str, ckpt_dir: str | None) -> dict | None:
    from slurm_etc.protocol.messages import LayoutSpec, Resize, pack_runs
    from slurm_etc.worker.sequence import _digest
    from slurm_etc.worker.trainer import TrainerHooks

    if ctx.index not in case.devices:
        return None
    store = _store(port)
    order = Resize(job, 1, LayoutSpec.of(Layout(case.old, case.devices)),
                   LayoutSpec.of(Layout(case.new, case.new_devices)),
                   pool_runs=pack_runs(case.new_devices), gpus_per_node=1, lost=case.die,
                   reason="node lost without grace")
    trainer = _trainer(case, ckpt_dir)
    trainer.hooks = TrainerHooks(stale_peer_copies=case.stale)
    control = LossControl(store, f"{job}/dead", order)
    why = trainer.run(_proc(case, ctx.index, store, control, job))
    out = {"why": why, "history": [vars(h) for h in trainer.history],
           "lost_history": [vars(h) for h in trainer.lost_history],
           "resizes": [vars(r) for r in trainer.resizes],
           "reports": [r for r in control.reports if type(r).__name__ == "Resized"],
           "digest": _digest(trainer)}
    trainer.close()
    return out


# -- the test's side ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def pool():
    with LocalWorkers(POOL, preload=PRELOAD, timeout_s=600) as workers:
        yield workers


@pytest.fixture(scope="module")
def references(pool):
    """(case name) -> step -> record of megatron's checkpoint-restart (cached per switch)."""
    cache: dict = {}

    def get(case: Case, switch_at: int) -> dict:
        key = (case.old, case.new, switch_at)
        if key not in cache:
            cache[key] = _checkpoint_reference(pool, case, switch_at)
        return cache[key]

    return get


def _checkpoint_reference(pool, case: Case, switch_at: int) -> dict:
    seq = ResizeSequence(MODEL, (case.old, case.new), steps=1, global_batch=GB, seed=SEED,
                         ends=(switch_at, STEPS), total_steps=STEPS)
    tmp = tempfile.mkdtemp(prefix="slurm-etc-lost-ref-")
    out: dict[int, dict] = {}
    try:
        for g in range(2):
            load = os.path.join(tmp, "g0") if g else None
            save = os.path.join(tmp, "g0") if g == 0 else None
            results = pool.run(w_checkpoint_segment, seq, g, load, save, f"ref-{case.name}-{g}")
            for r in results:
                for h in (r or {}).get("history", []):
                    out.setdefault(h["step"], h)
        out["final_state"] = results[0]["digest"]  # new layout's rank 0 (dp=1: all of it)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def run_case(pool, case: Case) -> list[dict | None]:
    import torch.distributed as dist

    job = f"lost-{case.name}-{os.getpid()}-{time.monotonic_ns()}"
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ckpt_dir = tempfile.mkdtemp(prefix="slurm-etc-lost-ckpt-") if case.ckpt_every else None
    ctx = multiprocessing.get_context("spawn")
    old_env = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        dying = [ctx.Process(target=dying_main, args=(case, v, store.port, job, ckpt_dir))
                 for v in case.die]
        for p in dying:
            p.start()
        codes: list = []

        def watch() -> None:  # the coordinator's loss detection
            for p in dying:
                p.join(TIMEOUT_S * 3)
                codes.append(p.exitcode)
            if all(c == -signal.SIGKILL for c in codes):
                store.set(f"{job}/dead", "1")

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        out = pool.run(w_survivor, case, store.port, job, ckpt_dir, timeout_s=TIMEOUT_S * 4)
        watcher.join(10)
        assert codes == [-signal.SIGKILL] * len(dying), codes
        return out
    finally:
        if old_env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old_env
        for p in dying:
            if p.is_alive():
                p.kill()
        if ckpt_dir:
            shutil.rmtree(ckpt_dir, ignore_errors=True)


def oracle(survivor: dict, reference: dict) -> list[str]:
    """Differences between the job's kept and replayed steps and checkpoint-restart, and
    between the final states (every shard's bits)."""
    problems = []
    want_state, got_state = reference["final_state"], survivor["digest"]
    if not want_state or got_state != want_state:
        differ = sorted(k for k in set(want_state) | set(got_state)
                        if want_state.get(k) != got_state.get(k))
        problems.append(f"final state: {len(differ)} shards differ, e.g. {differ[:1]}")
    steps = [h["step"] for h in survivor["history"]]
    if steps != list(range(1, STEPS + 1)):
        problems.append(f"steps trained and kept: {steps}")
    for h in survivor["history"]:
        ref = reference.get(h["step"])
        got = (h["loss"], h["lr"], h["consumed_samples"])
        want = ref and (ref["loss"], ref["lr"], ref["consumed_samples"])
        if got != want:
            problems.append(f"step {h['step']}: {got} != checkpoint-restart {want}")
    return problems


def _lost_steps(out: dict) -> tuple[int, int]:
    [rec] = [r for r in out["resizes"] if r["generation"] == 1]
    assert rec["outcome"] == "committed", rec
    return tuple(rec["lost_steps"])


@pytest.mark.parametrize("name", ["dist-opt", "dp1-pp2"])
def test_peer_copies_rebuild_what_no_replica_holds(pool, references, name):
    case = CASES[name]
    out = run_case(pool, case)[0]
    assert out["why"] == "done"
    # refreshed at 2 and 4, died in step 6: step 5 lost, replayed from 4's copies
    assert _lost_steps(out) == (5, 5)
    assert [h["step"] for h in out["lost_history"]] == [5]
    assert [r.lost_steps for r in out["reports"] if r.generation == 1] == [(5, 5)]
    assert [h["layout"] for h in out["history"]] == \
        [str(case.old)] * 4 + [str(case.new)] * (STEPS - 4)
    assert oracle(out, references(case, 4)) == []


def test_node_and_its_buddy_lost_restore_the_checkpoint(pool, references):
    case = CASES["node+buddy"]
    out = run_case(pool, case)[0]
    assert out["why"] == "done"
    assert _lost_steps(out) == (5, 5)
    assert "checkpoint of step 4" in out["resizes"][-1]["error"]
    assert oracle(out, references(case, 4)) == []


def test_stale_peer_copy_is_caught_by_the_oracle(pool, references):
    case = CASES["stale"]
    out = run_case(pool, case)[0]
    assert out["why"] == "done" and _lost_steps(out) == (5, 5)
    problems = oracle(out, references(case, 4))
    # the kept steps agree; the replayed ones and the final state do not
    steps = [int(p.split()[1].rstrip(":")) for p in problems if p.startswith("step ")]
    assert steps and min(steps) >= 5, problems
    assert any(p.startswith("final state") for p in problems), problems


def test_overhead_bench_prints_memory_and_step_time():
    """bench/redundancy_overhead.py runs (CI) and its figures hold together: no memory
    without peer copies; with them, an own snapshot and the ward's copy at least, two of
    each at most (plus alignment)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "bench" / "redundancy_overhead.py"
    done = subprocess.run([sys.executable, str(bench), "--steps", "5", "--every", "0,1",
                           "--repeat", "1", "--json"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {r["every"]: r for r in json.loads(done.stdout)["rows"]}
    assert rows[0]["peak_bytes"] == 0 and rows[0]["step_s"] > 0
    one = rows[1]
    assert 1.9 * one["state_bytes"] <= one["peak_bytes"] <= 4.2 * one["state_bytes"], one
    assert one["step_s"] > 0 and one["step_overhead"] is not None
    bad = subprocess.run([sys.executable, str(bench), "--every", "1,x"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "expected integers" in bad.stderr
    assert "Traceback" not in bad.stderr
