"""The honest pause on a real local run: ``slurm-etc demo`` as ``make demo`` runs it
(real worker processes, the coordinator, its SQLite record), its output to a pipe.

Every committed resize's recorded pause equals the training gap computed from the per-step
times the workers logged (the largest over the new layout's processes of first-new-step
start minus last-old-step end) within 0.05 s; two planted errors (the gap from the last old
step's start; the workers' own timing around the resize code, which the record held before)
are caught by the same check. The stall before each pause (the boundary at which a stayer
built the new world while the old layout trained) is recorded as the widest gap between two
old-layout steps inside the preparation, checked the same way (planted: left out). The loss
falls across the resizes (byte-level text), no gap between steps lies outside a measured
pause or a recorded stall, and the tables keep one row a line in a pipe.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from slurm_etc.store import job_detail, list_jobs
from slurm_etc.store.db import open_store_readonly
from tests.unit.openmetrics_check import pause_histogram

from .pause_check import (
    interrupted_steps,
    mismatches,
    preparation_stalls,
    steps_from_logs,
    training_gaps,
    worker_timed_pauses,
    world_builds,
)

STALL_TOLERANCE_S = 0.02
PAUSE_TOLERANCE_S = 0.05  # mismatches' default

pytestmark = [pytest.mark.dist, pytest.mark.timeout(1500)]

CLI = [sys.executable, "-c", "from slurm_etc.cli.main import main; main()"]
STEPS = 200  # the demo's default, in steps trained settled (the warm-ups train more)
UNCOVERED_S = 0.5  # between two steps outside any pause: agreement, bookkeeping


def test_the_recorded_pause_is_the_gap_between_steps(tmp_path):
    out = tmp_path / "demo"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("COLUMNS", None)
    run = subprocess.run([*CLI, "demo", "--out", str(out), "--steps", str(STEPS)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         timeout=1400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    store = open_store_readonly(out / "demo.db")
    try:
        (job,) = list_jobs(store)
        detail = job_detail(store, job.job_id)
    finally:
        store.close()
    assert detail is not None and detail.job.state == "finished"
    # the four events all happened (the script's end_step ended training after the loss)
    kinds = [e.kind for e in detail.events]
    assert [k for k in kinds if k in ("grant", "preempt-notice", "loss")][-4:] == \
        ["grant", "preempt-notice", "grant", "loss"], kinds
    assert "events did not all happen" not in run.stderr
    committed = [m for m in detail.migrations if m.outcome == "committed"]
    sizes = {g.number: g.world_size for g in detail.generations}
    assert len(committed) == 4
    for m in committed:  # measured over every process of the new layout
        assert m.pause_measured and m.pause_processes == sizes[m.to_generation], m
        assert m.data_seconds is not None and m.pause_seconds >= m.data_seconds
        assert m.paused_at is not None and m.resumed_at is not None
        assert abs((m.resumed_at - m.paused_at).total_seconds() - m.pause_seconds) < 1e-3

    steps = steps_from_logs(out / "workers")
    gaps = training_gaps(steps)
    recorded = {m.to_generation: m.pause_seconds for m in committed}
    assert sorted(gaps) == sorted(recorded)
    assert mismatches(recorded, gaps, PAUSE_TOLERANCE_S) == []
    # planted: measured from the wrong point (the last old step's start), the same check
    # fails wherever that step outlasted twice the tolerance (a demo step is 0.04-0.3 s)
    planted = training_gaps(steps, from_start=True)
    shifted = {g for g in gaps if planted[g] - gaps[g] > 2 * PAUSE_TOLERANCE_S}
    caught = mismatches(recorded, planted, PAUSE_TOLERANCE_S)
    assert {g for g in shifted if any(f"generation {g}:" in c for c in caught)} == shifted
    # planted: every recorded pause off by twice the tolerance, each caught (whatever the
    # steps' lengths, which decide how far the plant above moves a gap)
    off = {g: p + 2 * PAUSE_TOLERANCE_S for g, p in recorded.items()}
    assert len(mismatches(off, gaps, PAUSE_TOLERANCE_S)) == len(gaps)
    assert mismatches(worker_timed_pauses(out / "workers"), gaps), \
        "the workers' timing around the resize code went unnoticed"
    # of the loss's gap, the step in flight when the node died (last step's end to the
    # failure the survivor logged) is recorded apart, the same way; the resizes have none
    cut = interrupted_steps(out / "workers", steps)
    recorded_cut = {m.to_generation: m.interrupted_seconds for m in committed}
    assert mismatches(recorded_cut, cut) == []
    loss_gen = committed[-1].to_generation
    assert all(cut[g] == 0 for g in cut if g != loss_gen), cut
    # planted: the step in flight counted as recovery (nothing recorded apart), caught
    # where the failure came mid-step (after the last step had ended, not right at it)
    if cut[loss_gen] > 0.05:
        assert mismatches({g: 0.0 for g in recorded_cut}, cut)

    # the loss falls across the resizes: the data is learnable
    losses = {}
    for line in re.finditer(r"vrank 0\] step (\d+) loss (\S+)",
                            "".join(p.read_text() for p in (out / "workers").glob("*.log"))):
        losses[int(line.group(1))] = float(line.group(2))
    last = max(losses)
    # every step logged once; more than the demo's settled steps (the warm-ups trained too),
    # and fewer than the workers' budget (the script's end stopped training)
    assert sorted(losses) == list(range(1, last + 1))
    assert STEPS < last < 5 * STEPS, last
    assert losses[last] < losses[1] - 0.5, losses

    # the stall before each pause (the stayers' one boundary that builds the new world while
    # the old layout trains) is recorded too: the widest gap between two old-layout steps
    # inside the preparation, from the per-step times, within 0.02 s (the worker's own step
    # times on both sides; stalls are 0.03-0.08 s since megatron's groups of one membership
    # are one gloo group, so 0.05 s would no longer tell a stall from none)
    windows = {m.to_generation: (m.paused_at.timestamp() - (m.preparation_seconds or 0.0),
                                 m.paused_at.timestamp()) for m in committed}
    stalls = preparation_stalls(steps, windows)
    recorded_stalls = {m.to_generation: m.stall_seconds for m in committed}
    assert mismatches(recorded_stalls, stalls, STALL_TOLERANCE_S) == []
    builds = world_builds(out / "workers")
    assert len({round(a) for a, _ in builds}) >= 2  # each grow built its world while training
    # planted: the stall left out of the record (what it held before), the same check fails
    # wherever the stall outlasts twice the tolerance (on these cores, 0.03-0.08 s)
    left_out = mismatches({g: 0.0 for g in recorded_stalls}, stalls, STALL_TOLERANCE_S)
    long = {g for g, v in stalls.items() if v > 2 * STALL_TOLERANCE_S}
    assert {g for g in long if any(f"generation {g}:" in c for c in left_out)} == long
    # planted: every recorded stall off by twice the tolerance, each caught
    off = {g: (v or 0.0) + 2 * STALL_TOLERANCE_S for g, v in recorded_stalls.items()}
    assert len(mismatches(off, stalls, STALL_TOLERANCE_S)) == len(stalls)

    # no time between steps outside what the record says: a measured pause, or a recorded
    # stall inside its resize's preparation (the timeline has no hidden gap)
    spans = sorted((s.started, s.ended) for s in steps)
    pauses = [(m.paused_at.timestamp(), m.resumed_at.timestamp()) for m in committed]
    stalled = [(windows[m.to_generation], m.stall_seconds or 0.0) for m in committed]
    reach = spans[0][1]
    for started, ended in spans[1:]:
        if started - reach > UNCOVERED_S:
            in_pause = any(a - 0.05 <= reach and started <= b + 0.05 for a, b in pauses)
            in_stall = any(a - 0.05 <= reach and started <= b + 0.05
                           and started - reach <= stall + 0.05 for (a, b), stall in stalled)
            assert in_pause or in_stall, \
                f"training stopped {started - reach:.2f} s at {reach:.2f} outside any pause"
        reach = max(reach, ended)

    # the summary in a pipe: each resize a line, its pause beside its data phase
    for m in committed:
        row = [ln for ln in run.stdout.splitlines()
               if ln.strip().startswith(f"{m.from_generation}->{m.to_generation} ")
               and "MiB" in ln and "committed" not in ln]
        assert len(row) == 1, run.stdout
        cells = row[0].split()
        assert f"{m.data_seconds:.2f}" in cells and f"{m.pause_seconds:.2f}" in cells, row
        assert f"{m.stall_seconds:.2f}" in cells, row
    gen_rows = [ln for ln in run.stdout.splitlines() if re.match(r"\s+\d+\s+dp=", ln)]
    assert len(gen_rows) == len(detail.generations), run.stdout

    shown = subprocess.run([*CLI, "status", job.job_id, "--db", str(out / "demo.db"),
                            "--json"], capture_output=True, text=True, timeout=120, check=True)
    (as_json,) = json.loads(shown.stdout)["jobs"]
    assert [m["pause_seconds"] for m in as_json["migrations"]] == \
        [m.pause_seconds for m in detail.migrations]
    assert [m["stall_seconds"] for m in as_json["migrations"]] == \
        [m.stall_seconds for m in detail.migrations]
    assert all(m["pause_measured"] for m in as_json["migrations"])

    # the same record as Prometheus metrics (issue #44): the pause histogram counts the
    # committed resizes, its sum their recorded pauses
    scraped = subprocess.run([*CLI, "status", "--db", str(out / "demo.db"), "--format",
                              "openmetrics"], capture_output=True, text=True, timeout=120,
                             check=True)
    pause = pause_histogram(scraped.stdout, job.job_id)
    assert pause["count"] == len(committed)
    assert abs(pause["sum"] - sum(m.pause_seconds for m in committed)) < 1e-9
