"""A new layout's widest gap and stall found by its ranks together (``worker/reporting.py:
Reporting._widest_resumed``) over a real gloo group of 4 processes: only the ranks named
report, each for all (``widest_of``, ``stall_of`` = 4), the others say nothing; ties go to
the lowest vrank, an unknown end (a joiner that found none) never wins the gap. The expected
ranks come from the definition in plain arithmetic, not from the codes; a planted reduction
(MIN for MAX) is caught."""
from __future__ import annotations

import pytest

from tests.dist.harness import pool_fixture

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

pool4 = pool_fixture(4, preload=("slurm_etc.worker.reporting",))

VRANKS = (12, 3, 40, 7)  # rank -> vrank: not in rank order, so a tie by vrank is not by rank

# (gap s, stall s) a rank; None: no end known
CASES = {
    "distinct": [(1.25, 0.0), (2.5, 0.0), (0.75, 0.5), (1.0, 0.0)],
    "tie-to-lowest-vrank": [(2.0, 0.25), (1.0, 0.25), (0.5, 0.0), (2.0, 0.0)],
    "negative-gaps": [(-0.5, 0.0), (-0.25, 0.0), (-1.0, 0.0), (-3.0, 0.0)],
    "unknown-end": [(None, 0.0), (0.5, 0.0), (0.25, 0.75), (None, 0.0)],
}


def _report(rank: int, world: int, case: list, plant: bool = False):
    import types

    import torch.distributed as dist

    from slurm_etc.protocol.messages import Resumed
    from slurm_etc.worker.reporting import Reporting

    gap, stalled = case[rank]
    own = Resumed("j", 2, VRANKS[rank], 5, 1000.0, None if gap is None else 1000.0 - gap,
                  stalled=stalled)
    real = dist.all_reduce
    if plant:  # the planted bug: the lowest codes win
        dist.all_reduce = lambda t, op=None, **kw: real(t, op=dist.ReduceOp.MIN, **kw)
    try:
        got = Reporting._widest_resumed(types.SimpleNamespace(), own)
    finally:
        dist.all_reduce = real
    return None if got is None else (got.vrank, got.widest_of, got.stall_of)


def _by_definition(case: list) -> list:
    """The reports expected: the widest known gap's vrank and the widest stall's, ties to
    the lowest vrank, each with the layout's size."""
    known = [(gap, v) for (gap, _), v in zip(case, VRANKS, strict=True) if gap is not None]
    widest = min(known, key=lambda gv: (-gv[0], gv[1]))[1]
    stall = min(((s, v) for (_, s), v in zip(case, VRANKS, strict=True)),
                key=lambda sv: (-sv[0], sv[1]))[1]
    out = []
    for v in VRANKS:
        if v in (widest, stall):
            out.append((v, 4 if v == widest else 0, 4 if v == stall else 0))
        else:
            out.append(None)
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_only_the_widest_gaps_and_stalls_ranks_report_for_all(pool4, name):
    case = CASES[name]
    got = pool4.run(_report, case)
    assert got == _by_definition(case), (name, got)
    assert 1 <= sum(r is not None for r in got) <= 2


def test_a_planted_reduction_is_caught(pool4):
    case = CASES["distinct"]
    assert pool4.run(_report, case, plant=True) != _by_definition(case)
