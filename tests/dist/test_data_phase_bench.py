"""bench/data_phase.py on tiny (tp 2 -> 4, pp 2 -> 1), once as it runs and once with
``--diagnose scratch``: the JSON is complete, and the diagnostic really takes the local
copies, the packing and the shards' memory out of the data phase (the run without it is the
contrast: there the same ranks copy locally).

No timing is asserted (the machine is shared); only which parts ran.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
ARGS = [sys.executable, str(ROOT / "bench" / "data_phase.py"), "--model", "tiny",
        "--from", "dp=1,tp=2,pp=2", "--to", "dp=1,tp=4,pp=1", "--repeat", "1", "--json"]


def run(*extra: str) -> dict:
    r = subprocess.run([*ARGS, *extra], capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["data_seconds"] > 0 and out["raw_pattern_seconds"] > 0
    assert out["data_over_raw_pattern"] == pytest.approx(
        out["raw_pattern_seconds"] / out["data_seconds"])
    ranks = out["median_run_ranks"]
    assert len(ranks) == 4 and all(r["data_seconds"] > 0 for r in ranks)
    return out


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    return {"as-run": run(), "scratch": run("--diagnose", "scratch")}


def copied_locally(rank: dict) -> int:
    return rank["local_bytes"] - rank["kept_whole_bytes"] - rank["in_place_bytes"]


def test_the_data_phase_as_it_runs_copies_locally(runs):
    out = runs["as-run"]
    assert out["diagnose"] is None
    # every rank keeps a quarter of its old halves: copied in the pause, nothing placed
    assert all(copied_locally(r) > 0 and r["local_seconds"] > 0
               for r in out["median_run_ranks"])


def test_scratch_takes_copies_packing_and_the_shards_out(runs):
    out = runs["scratch"]
    assert out["diagnose"] == "scratch"
    for r in out["median_run_ranks"]:
        assert copied_locally(r) > 0  # the plan still has local copies ...
        assert r["local_seconds"] == 0  # ... the diagnostic skipped them
        assert r["pack_seconds"] == 0 and r["direct_bytes"] == 0
        assert r["sent_bytes"] > 0 and r["received_bytes"] > 0
