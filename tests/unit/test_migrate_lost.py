"""The executor and the step/RNG exchange around lost devices, in one process (threads).

Only ``plan.participants`` (old ∪ new minus lost) take part: the migration group, the
programs, the votes and the resume exchange are sized to them; dead processes call nothing.
"""
from __future__ import annotations

import threading

import pytest

from slurm_etc.megatron.state import (
    RNG_BYTES,
    ResumeState,
    StateError,
    exchange_resume_state,
    plan_rng_source,
    rng_source,
)
from slurm_etc.migrate.executor import MigrationOptions
from slurm_etc.migrate.program import compile_program, group_devices, program_digest
from slurm_etc.migrate.threads import run_threads
from slurm_etc.migrate.transport import ThreadHub
from slurm_etc.plan import PRESETS, Layout, ParallelConfig, Topology, plan_migration
from slurm_etc.testing.fake_state import fake_shards, shard_mismatches

OPTS = MigrationOptions(measure_memory=False, timeout_s=20)
TOPO = Topology(gpus_per_node=4)


def _plan(model, old, new, pool, lost, dist=False):
    oc = ParallelConfig(*old, distributed_optimizer=dist)
    return plan_migration(PRESETS[model], Layout(oc, tuple(range(oc.world))),
                          ParallelConfig(*new, distributed_optimizer=dist), pool, TOPO,
                          keep_tp_in_node=False, lost=lost)


def _survivor_state(plan):
    lost = set(plan.lost)
    return {d: fake_shards(plan, r) for r, d in enumerate(plan.old.devices) if d not in lost}


@pytest.mark.parametrize("model,old,new,pool,lost", [
    ("tiny", (2, 1, 2), (1, 2, 1), [1, 3], [0, 2]),
    ("tiny-llama", (2, 2, 1), (1, 2, 2), [0, 1, 4, 5], [2, 3]),
    ("tiny", (4, 1, 1), (2, 1, 2), [0, 2, 4, 5], [1]),     # a survivor departs (3)
])
def test_survivors_commit_without_the_dead(model, old, new, pool, lost):
    plan = _plan(model, old, new, pool, lost)
    assert group_devices(plan) == plan.participants
    assert not set(plan.participants) & set(lost)
    results = run_threads(plan, _survivor_state(plan), options=OPTS)
    assert set(results) == set(plan.participants)
    for d, res in results.items():
        assert not isinstance(res, BaseException), f"device {d}: {res}"
        assert shard_mismatches(plan, res.new_rank, res.new_shards) == [], d
        assert res.departing == (d not in plan.new.devices)


def test_a_lost_device_has_no_program():
    plan = _plan("tiny", (2, 1, 2), (1, 1, 2), [0, 2], [1, 3])
    with pytest.raises(ValueError, match=r"takes no part .*lost devices \(1, 3\)"):
        compile_program(plan, 1)
    prog = compile_program(plan, 2)
    assert prog.group_devices == (0, 2) and prog.group_rank == 1


def test_the_program_digest_tells_a_plan_with_lost_devices_from_one_without():
    a = _plan("tiny", (2, 1, 2), (1, 1, 2), [0, 2], [1, 3])
    b = _plan("tiny", (2, 1, 2), (1, 1, 2), [0, 2], [])
    assert a.messages.src.tolist() == b.messages.src.tolist()
    assert program_digest(a, 1 << 20) != program_digest(b, 1 << 20)


def test_rng_source_falls_back_to_the_lowest_surviving_dp_rank():
    old, new = ParallelConfig(2, 1, 2), ParallelConfig(1, 2, 1)
    # new rank 1 (t=1, stage 0): the default source is old rank (t % 1, d % 2, p) = 0
    assert rng_source(old, new, 1, 4) == 0
    assert rng_source(old, new, 1, 4, lost_ranks={0, 2}) == 1
    old4 = ParallelConfig(4, 1, 2)
    assert rng_source(old4, ParallelConfig(4, 1, 1), 2, 4, lost_ranks={2, 0}) == 1
    assert rng_source(old4, ParallelConfig(4, 1, 1), 2, 4, lost_ranks={1}) == 2
    with pytest.raises(StateError, match="every old rank with tp=0, pp=0"):
        rng_source(old, new, 0, 4, lost_ranks={0, 1})


def _exchange(plan, states):
    devices = plan.participants
    hub = ThreadHub(len(devices))
    out = {}

    def work(rank, device):
        try:
            out[device] = exchange_resume_state(plan, hub.transports()[rank], device,
                                                states.get(device), timeout_s=20)
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out[device] = exc

    threads = [threading.Thread(target=work, args=(r, d)) for r, d in enumerate(devices)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def _rng(k):
    return bytes([k]) * RNG_BYTES


def test_resume_exchange_skips_lost_ranks_and_continues_a_survivor():
    # dp=2,tp=1,pp=2 on devices 0..3; replica 0 (devices 0, 2) died; dp=1,tp=2,pp=1 on 1, 3
    plan = _plan("tiny", (2, 1, 2), (1, 2, 1), [1, 3], [0, 2])
    states = {d: ResumeState(7, _rng(d)) for d in (1, 3)}
    out = _exchange(plan, states)
    assert set(out) == {1, 3}
    for d, res in out.items():
        new_rank = plan.new.devices.index(d)
        src = plan_rng_source(plan, new_rank)
        assert src == 1  # both new ranks start stage 0: the surviving dp rank 1 of stage 0
        assert res == ResumeState(7, _rng(plan.old.devices[src]))


def test_resume_exchange_still_requires_every_survivor():
    plan = _plan("tiny", (2, 1, 2), (1, 1, 2), [0, 2], [1, 3])
    out = _exchange(plan, {0: ResumeState(3, _rng(0))})
    assert all(isinstance(r, StateError) and "old rank 2 (device 2) sent no step" in str(r)
               for r in out.values())

