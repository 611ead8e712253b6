"""The raw message pattern (the data phase's reference) is the plan's own pattern.

Checked against the plan's message table directly (no code shared with pattern.py): every
ordered pair of devices exchanges exactly the plan's bytes, in the plan's rounds, whole
messages by default; chunked, it has the executor's own step list; and it runs over a
transport (threads) with every send received.
"""
from __future__ import annotations

import collections
import dataclasses
import threading

import pytest

from slurm_etc.migrate.pattern import pattern_steps, raw_pattern
from slurm_etc.migrate.program import compile_program, group_devices
from slurm_etc.migrate.transport import ThreadHub
from slurm_etc.plan import PRESETS
from tests.unit.plan_helpers import make_plan

TINY_BF16 = dataclasses.replace(PRESETS["tiny"], param_dtype="bf16")
CASES = [((1, 2, 1), (2, 2, 1), False), ((1, 2, 2), (2, 1, 2), False),
         ((2, 2, 2), (2, 1, 2), True), ((4, 1, 1), (2, 1, 1), True)]


def _plan_pairs(plan):
    """(src device, dst device) -> [(round, bytes)] straight from plan.messages."""
    out = collections.defaultdict(list)
    m = plan.messages
    for k in range(len(m)):
        out[(int(m.src[k]), int(m.dst[k]))].append((int(m.round[k]), int(m.nbytes[k])))
    return {k: sorted(v) for k, v in out.items()}


@pytest.mark.parametrize("old,new,dist_opt", CASES)
def test_whole_messages_are_the_plans_messages(old, new, dist_opt):
    plan = make_plan(TINY_BF16, old, new, dist=dist_opt)
    devices = group_devices(plan)
    rounds_of_step = sorted({int(r) for r in plan.messages.round})
    sent, received = collections.defaultdict(list), collections.defaultdict(list)
    for d in devices:
        steps = pattern_steps(plan, d)
        assert len(steps) == len(rounds_of_step)  # one step per round that has messages
        for i, (sends, recvs) in enumerate(steps):
            assert len(sends) <= 1 and len(recvs) <= 1
            for peer, n in sends:
                sent[(d, devices[peer])].append((rounds_of_step[i], n))
            for peer, n in recvs:
                received[(devices[peer], d)].append((rounds_of_step[i], n))
    want = _plan_pairs(plan)
    assert {k: sorted(v) for k, v in sent.items()} == want
    assert {k: sorted(v) for k, v in received.items()} == want


@pytest.mark.parametrize("old,new,dist_opt", CASES)
def test_chunked_pattern_walks_the_executors_steps(old, new, dist_opt):
    plan = make_plan(TINY_BF16, old, new, dist=dist_opt)
    staging = 4 * 7001
    for d in group_devices(plan):
        prog = compile_program(plan, d, staging)
        steps = pattern_steps(plan, d, prog.chunk_bytes)
        assert len(steps) == len(prog.steps)
        for st, (sends, recvs) in zip(prog.steps, steps):
            assert bool(sends) == (st.send is not None)
            assert bool(recvs) == (st.recv is not None)
            if st.send is not None:
                c0, c1 = prog.chunk(prog.sends[st.send], st)
                assert sends == [(prog.sends[st.send].peer, c1 - c0)]


def test_raw_pattern_runs_on_a_transport_and_delivers_everything():
    plan = make_plan(TINY_BF16, (2, 2, 2), (2, 1, 2), dist=True)
    devices = group_devices(plan)
    hub = ThreadHub(len(devices))
    out: dict = {}

    def work(rank, device):
        out[device] = raw_pattern(plan, hub.transports()[rank], device, repeats=2,
                                  timeout_s=20)

    threads = [threading.Thread(target=work, args=(r, d)) for r, d in enumerate(devices)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(out) == list(devices)
    assert all(len(v) == 2 and all(x > 0 for x in v) for v in out.values())
    assert not any(box.qsize() for box in hub._boxes.values())
