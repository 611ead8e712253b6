"""The elastic trainer, its resizes and the executor make every tensor on a named device
(issue #41): on a GPU a tensor made without one lands in host memory, and nothing on a CPU
run shows it. Real worker processes train a preset through resizes (joiners, leavers, a tp
and pp change, the distributed optimizer) under the recorder of
:mod:`slurm_etc.testing.device_routing`, which sees each factory call made from the
runtime's own files; the recorder is shown to catch a planted creation without a device
in the same processes."""
from __future__ import annotations

import pytest

from slurm_etc.plan.model import PRESETS
from slurm_etc.pool.local import LocalWorkers
from slurm_etc.worker.sequence import (
    PRELOAD,
    ResizeSequence,
    default_global_batch,
    parse_sequence,
    w_elastic,
)

pytestmark = [pytest.mark.dist, pytest.mark.timeout(1200)]

CASES = [("dp=2,tp=1,pp=1 -> dp=1,tp=2,pp=2 -> dp=2,tp=1,pp=1", True),
         ("dp=1,tp=1,pp=2 -> dp=4,tp=1,pp=1 -> dp=1,tp=2,pp=1", False)]


@pytest.fixture(scope="module")
def pool():
    with LocalWorkers(4, preload=PRELOAD) as workers:
        yield workers


def w_recorded(ctx, seq, layouts, digests, job, plant=False):
    """One worker's stints in the sequence under the recorder: what it found, how many
    runtime creations it checked, whether it trained."""
    import torch

    import slurm_etc.migrate.executor as executor
    from slurm_etc.megatron import cpu_compat
    from slurm_etc.testing.device_routing import recording

    if not torch.cuda.is_available():
        cpu_compat.install()  # below the recorder: modes leave their stack in order
    real = executor.allocate_staging
    try:
        with recording("cpu") as rec:
            if plant:
                _plant_in_the_runtime()
            out = w_elastic(ctx, seq, layouts, digests, job)
    finally:
        executor.allocate_staging = real
    return {"found": rec.found, "seen": rec.seen, "steps": len(out["history"]),
            "exits": out["exits"]}


def _plant_in_the_runtime():
    """A runtime function (the executor's staging allocation) replaced by one compiled as
    if written in its file, with ``torch.empty`` and no device."""
    import slurm_etc.migrate.executor as executor

    namespace = dict(vars(executor))
    source = ("def allocate_staging(prog, options, transport, *, prefault=True):\n"
              "    send, recv = ([torch.empty(size, dtype=torch.uint8) for _ in range(count)]\n"
              "                  for size, count in _staging_layout(prog, options))\n"
              "    return send, recv\n")
    exec(compile(source, executor.__file__, "exec"), namespace)
    executor.allocate_staging = namespace["allocate_staging"]


def _run(pool, text, dist_opt, plant=False):
    configs = parse_sequence(text, dist_opt)
    seq = ResizeSequence(PRESETS["tiny"], tuple(configs), steps=2,
                         global_batch=default_global_batch(configs))
    layouts, digests = seq.layouts()
    job = f"routing-{abs(hash((text, dist_opt, plant)))}"
    return pool.run(w_recorded, seq, layouts, digests, job, plant)[:seq.processes]


@pytest.mark.parametrize("text,dist_opt", CASES, ids=[f"{t}{':dist-opt' * d}" for t, d in CASES])
def test_the_trainer_and_its_resizes_name_a_device_for_every_tensor(pool, text, dist_opt):
    results = _run(pool, text, dist_opt)
    assert sum(r["seen"] > 0 for r in results) >= 2  # the processes' creations were checked
    assert sum(r["steps"] for r in results) > 0
    assert [f for r in results for f in r["found"]] == []


def test_the_recorder_catches_a_planted_creation_in_the_resize(pool):
    results = _run(pool, CASES[0][0], CASES[0][1], plant=True)
    found = {f for r in results for f in r["found"]}
    assert found and all(f.startswith("migrate/executor.py:2: torch.empty without a device")
                         for f in found), found
