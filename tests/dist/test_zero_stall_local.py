"""A grow on the path users run (the coordinator, the local backend, the preset trainer over
the authenticated channel): the old layout trains on while the joiners start and warm up,
and while every process prepares the resize (the migration group in a thread, the new world
at a step boundary); it pauses only at a later step boundary, for the data phase, the vote
and the switch. Real processes, gloo, the SQLite record.

Figures it prints (-s): the joiners' warm-up the old layout trained through, the old
layout's step time while preparing against before, and the training gap across the resize
as the coordinator saw the progress reports arrive.
"""
from __future__ import annotations

import logging
import re
import time

import pytest

from slurm_etc.coordinator.run import run_job
from slurm_etc.local.backend import LocalBackend
from slurm_etc.local.demo import demo_spec
from slurm_etc.local.script import script_from_dict
from slurm_etc.plan import ParallelConfig
from slurm_etc.plan.model import PRESETS
from slurm_etc.store import jobs as record
from slurm_etc.store.db import open_store_readonly
from slurm_etc.worker.sequence import ResizeSequence, checkpoint_losses

pytestmark = [pytest.mark.dist, pytest.mark.timeout(1800)]

# The grant comes at step 4 and training ends 40 steps after the grow, counted while no
# resize is in flight (the script's settled steps and end_step): the old layout trains
# through the joiners' warm-up, as many steps as this machine's speed allows (a fixed budget
# ran out before the joiners were ready on a faster machine), bounded by the workers' BUDGET.
GRANT_AT, END_AT, BUDGET = 4, 44, 5000
ORDERED = re.compile(r"generation 1: old layout ordered ([\d.]+) s after the joiners' launch, "
                     r"steps (\d+)\.\.(\d+) trained meanwhile")
PREPARED = re.compile(r"prepared while training: transfer ([\d.]+) s, new world ([\d.]+) s; "
                      r"(\d+) step\(s\) trained meanwhile, ([\d.]+) s each against ([\d.]+) s")


def test_grow_trains_through_warm_up_and_preparation(tmp_path, caplog):
    caplog.set_level(logging.INFO, "slurm_etc")
    seen: list[tuple[float, dict]] = []
    script = script_from_dict({"nodes": 2, "gpus_per_node": 2, "initial_nodes": 1,
                               "settled_steps": True, "end_step": END_AT,
                               "events": [{"at_step": GRANT_AT, "grant": ["n1"]}]},
                              "<zero-stall>")
    backend = LocalBackend(script, log_dir=tmp_path / "workers")
    spec = demo_spec("zero-stall", PRESETS["tiny"], BUDGET)
    assert spec.order_after_joined and spec.prepare_while_training  # the defaults
    out = run_job(spec, backend, backend.topology, db=str(tmp_path / "job.db"),
                  state_dir=str(tmp_path / "state"),
                  progress=lambda p: seen.append((time.time(), p)), deadline_s=1700)
    steps = out["step"]
    assert out["state"] == "finished" and END_AT <= steps < BUDGET, out
    assert backend.unfired == (), backend.unfired
    store = open_store_readonly(tmp_path / "job.db")
    try:
        detail = record.job_detail(store, "zero-stall")
    finally:
        store.close()
    assert detail is not None
    assert [m.outcome for m in detail.migrations] == ["committed"], (
        [m.error for m in detail.migrations], caplog.text[-3000:])

    # the joiners warmed up while the old layout trained: steps between launch and order
    ordered = ORDERED.search(caplog.text)
    assert ordered, "no order line"
    warm_s, first, last = float(ordered[1]), int(ordered[2]), int(ordered[3])
    assert last - first >= 3, (first, last)

    # every old-layout process prepared while training, and trained steps meanwhile
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "workers").iterdir())
    prepared = PREPARED.findall(logs)
    assert len(prepared) == 2, logs[-3000:]  # the two old ranks
    assert all(int(n) >= 1 for _t, _w, n, _d, _b in prepared), prepared

    # the training gap across the resize, as the coordinator saw the steps arrive: far
    # shorter than the warm-up it trained through
    old = [t for t, p in seen if p["generation"] == 0]
    new = [t for t, p in seen if p["generation"] == 1]
    gap = min(new) - max(old)
    print(f"\nwarm-up trained through {warm_s:.2f} s (steps {first}..{last}); gap "
          f"{gap:.3f} s; pause recorded {detail.migrations[0].pause_seconds:.3f} s; "
          f"prepared (transfer s, world s, steps, step s, before s): {prepared}")
    assert gap < warm_s, (gap, warm_s)

    # the losses equal megatron-core's checkpoint-restart through the same layouts, resized
    # at the step the record says (wherever the preparation let the old layout get to)
    gens = sorted(detail.generations, key=lambda g: g.number)
    configs = tuple(ParallelConfig.parse(g.layout) for g in gens)
    seq = ResizeSequence(PRESETS["tiny"], configs, steps=1, global_batch=8,
                         ends=tuple(g.last_step for g in gens), total_steps=BUDGET)
    reference = checkpoint_losses(seq)
    losses = {p["step"]: p["loss"] for _t, p in seen}
    assert sorted(losses) == list(range(1, steps + 1))
    assert losses == {s: r["loss"] for s, r in reference.items()}
