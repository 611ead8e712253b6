"""One plan fingerprint (plan/fingerprint.py): what the coordinator orders and records, what
each worker compares after planning again, and what the executor's program digest extends."""
from __future__ import annotations

import subprocess
import sys

import pytest

from slurm_etc.migrate.program import program_digest
from slurm_etc.plan import Layout, ParallelConfig, Topology, plan_migration
from slurm_etc.plan.fingerprint import plan_digest, plan_fingerprint
from slurm_etc.plan.model import PRESETS

pytestmark = pytest.mark.unit

TOPO = Topology(gpus_per_node=2)


def _plan(new=(1, 2, 1), pool=(0, 1, 2, 3), model="tiny"):
    old = ParallelConfig(2, 1, 1)
    return plan_migration(PRESETS[model], Layout(old, (0, 1)), ParallelConfig(*new),
                          pool, TOPO)


def test_the_same_plan_made_twice_has_one_fingerprint_and_any_change_another():
    a, b = _plan(), _plan()
    assert a is not b and plan_fingerprint(a) == plan_fingerprint(b)
    assert plan_digest(a) == plan_fingerprint(a).hex() and len(plan_digest(a)) == 64
    others = [_plan(new=(2, 2, 1)), _plan(new=(1, 1, 2)), _plan(model="small"),
              _plan(new=(1, 2, 1), pool=(2, 3))]
    digests = {plan_digest(p) for p in [a, *others]}
    assert len(digests) == 1 + len(others)


def test_the_program_digest_is_the_fingerprint_and_the_chunking():
    a, b = _plan(), _plan()
    assert program_digest(a, 1 << 20) == program_digest(b, 1 << 20)
    assert program_digest(a, 1 << 20) != program_digest(a, 1 << 21)
    assert program_digest(a, 1 << 20) != program_digest(_plan(new=(2, 2, 1)), 1 << 20)
    assert 0 <= program_digest(a, 1 << 20) < 2**63


def test_the_coordinator_plans_without_importing_the_trainer():
    """The digest lives in the planner: the coordinator's loop no longer imports
    worker.trainer (and with it the training runtime) to compute it."""
    code = ("import sys, slurm_etc.coordinator.loop; "
            "print('slurm_etc.worker.trainer' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stdout
