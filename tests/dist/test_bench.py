"""`slurm-etc bench migrate`'s span arithmetic on synthetic clocks.

The real runs of both paths (tiny and a second size, through ``slurm-etc bench migrate
--json``), with every number of each report checked, are in test_migrate_scaling.py.
"""
from __future__ import annotations

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


def test_checkpoint_downtime_is_a_span_not_a_sum_of_maxima():
    """Synthetic clocks: the downtime runs from the first pause to the last rank ready, the
    slowest process started alone replaces the all-at-once cold start, and the parent's
    hand-offs between the parts show up only in the all-at-once span, measured in one
    piece."""
    from slurm_etc.harness.bench import checkpoint_spans

    save = {"pause": 100.0, "saved": 103.0, "stopped": 103.5}
    all_at_once = {"start_seconds": 7.5, "start_each": [7.2, 7.5, 7.4, 7.3],
                   "begin": 111.1, "ready": 112.1}
    per_core = {"start_seconds": 14.0, "start_each": [3.4, 3.5, 3.45, 3.3],
                "begin": 130.0, "ready": 131.25}
    out = checkpoint_spans(save, all_at_once, per_core)
    spans = out["spans"]
    assert spans["save"] == 3.0 and spans["stop"] == 0.5
    assert spans["cold_start"] == 3.5 and spans["cold_start_all_at_once"] == 7.5
    assert spans["build_load"] == 1.25 and spans["build_load_all_at_once"] == pytest.approx(1.0)
    assert out["checkpoint_seconds"] == pytest.approx(3.0 + 0.5 + 3.5 + 1.25)
    assert out["checkpoint_seconds_all_at_once"] == pytest.approx(12.1)
    assert spans["handoffs_all_at_once"] == pytest.approx(12.1 - (3.0 + 0.5 + 7.5 + 1.0))
