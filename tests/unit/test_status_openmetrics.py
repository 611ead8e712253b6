"""`slurm-etc status --format openmetrics` (issue #44): the record as Prometheus metrics,
read back with prometheus_client's OpenMetrics parser."""
from __future__ import annotations

import os
from datetime import datetime, timedelta, timezone

import pytest
from click.testing import CliRunner

from slurm_etc.alloc import Device
from slurm_etc.cli.main import cli
from slurm_etc.store import (
    create_job,
    open_generation,
    open_store,
    record_migration_finish,
    record_migration_start,
    record_progress,
    set_job_state,
)
from tests.unit.openmetrics_check import families, pause_histogram

pytestmark = pytest.mark.unit

T0 = datetime(2026, 12, 6, 12, 0, 0, tzinfo=timezone.utc)
NOW = {"now": lambda: T0 + timedelta(minutes=1, seconds=5)}  # the job heard from 5 s ago
PAUSES = [0.04, 0.26]  # the committed resizes' pauses; one more resize aborted


def _record(path):
    store = open_store(path)
    create_job(store, "301", name="gpt", owner_uid=os.getuid(), owner_name="me",
               backend="local", model="tiny", at=T0)
    open_generation(store, "301", 0, "dp=2,tp=1,pp=1", [0, 1],
                    {0: Device("n1", 0), 1: Device("n1", 1)}, first_step=0, at=T0)
    set_job_state(store, "301", "running", at=T0)
    for i, outcome in enumerate(["committed", "aborted", "committed"]):
        m = record_migration_start(store, "301", from_generation=0, to_generation=i + 1,
                                   plan_digest=f"d{i}", moved_bytes=100 * (i + 1),
                                   kept_bytes=1, lower_bound_bytes=90 * (i + 1), messages=1,
                                   rounds=1, estimated_seconds=0.1, at=T0)
        record_migration_finish(store, m, outcome=outcome, measured_seconds=0.5,
                                pause_seconds=PAUSES[i // 2] if outcome == "committed"
                                else None, at=T0 + timedelta(seconds=1))
    record_progress(store, "301", 0, last_step=120, last_loss=3.0, at=T0 + timedelta(minutes=1))
    store.close()


def test_the_record_as_openmetrics(tmp_path):
    _record(tmp_path / "site.db")
    run = CliRunner().invoke(cli, ["status", "--db", str(tmp_path / "site.db"), "--format",
                                   "openmetrics"], obj=NOW)
    assert run.exit_code == 0, run.output
    assert run.output.endswith("# EOF\n")
    found = families(run.output)
    pause = pause_histogram(run.output, "301")
    assert pause["count"] == len(PAUSES) and pause["sum"] == pytest.approx(sum(PAUSES))
    assert pause["le_0.05"] == 1 and pause["le_0.25"] == 1 and pause["le_0.5"] == 2
    resizes = {s.labels["outcome"]: s.value for s in found["slurm_etc_resizes"].samples}
    assert resizes == {"committed": 2, "aborted": 1}
    (moved,) = found["slurm_etc_migrated_bytes"].samples
    assert moved.value == 100 + 300 and moved.labels == {"job_id": "301", "owner": "me"}
    (info,) = found["slurm_etc_job"].samples
    assert info.labels["state"] == "running" and info.labels["layout"] == "dp=2,tp=1,pp=1"
    (steps,) = found["slurm_etc_job_steps"].samples
    assert steps.value == 120


def test_the_pause_check_catches_a_histogram_of_every_resize(tmp_path):
    _record(tmp_path / "site.db")
    run = CliRunner().invoke(cli, ["status", "--db", str(tmp_path / "site.db"), "--format",
                                   "openmetrics"], obj=NOW)
    # planted: the aborted resize counted too
    count = 'slurm_etc_resize_pause_seconds_count{job_id="301",owner="me"} '
    planted = run.output.replace(count + "2.0", count + "3.0")
    assert planted != run.output
    with pytest.raises(ValueError, match="Count does not match"):
        pause_histogram(planted, "301")  # the parser itself refuses the inconsistency
    # and where a whole histogram is planted consistently, the count check sees it
    consistent = planted.replace(
        'slurm_etc_resize_pause_seconds_bucket{job_id="301",le="+Inf",owner="me"} 2.0',
        'slurm_etc_resize_pause_seconds_bucket{job_id="301",le="+Inf",owner="me"} 3.0')
    assert pause_histogram(consistent, "301")["count"] != len(PAUSES)


def test_watch_refuses_openmetrics(tmp_path):
    _record(tmp_path / "site.db")
    run = CliRunner().invoke(cli, ["status", "--db", str(tmp_path / "site.db"), "--format",
                                   "openmetrics", "--watch"], obj=NOW)
    assert run.exit_code == 2 and "--watch redraws tables" in run.output


def test_the_dashboard_asks_only_for_series_the_exporter_writes(tmp_path):
    import json
    import re
    from pathlib import Path

    dashboard = Path(__file__).resolve().parents[2] / "docs" / "dashboards" / "slurm-etc.json"
    panels = json.loads(dashboard.read_text())["panels"]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    _record(tmp_path / "site.db")
    run = CliRunner().invoke(cli, ["status", "--db", str(tmp_path / "site.db"), "--format",
                                   "openmetrics"], obj=NOW)
    written = {s.name for f in families(run.output).values() for s in f.samples}
    asked = {name for e in exprs for name in re.findall(r"slurm_etc_\w+", e)}
    assert asked and asked <= written, asked - written
    assert all('job_id=~"$job_id"' in e for e in exprs)
