"""`slurm-etc run`: bad input is one line, exit 2, and nothing is started or written."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from slurm_etc.cli.main import cli
from slurm_etc.coordinator import run as run_module


@pytest.fixture
def never_runs(monkeypatch):
    def boom(*_a, **_k):
        raise AssertionError("run_job must not start on bad input")
    monkeypatch.setattr(run_module, "run_job", boom)


def _events(tmp_path, obj) -> str:
    path = tmp_path / "events.json"
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(path)


@pytest.mark.parametrize("events,message", [
    ("{not json", "events.json"),
    ({"nodes": 2, "events": [{"at_step": 3, "grant": ["n7"]}]},
     "node n7 does not exist"),
    ({"nodes": 2, "events": [{"at_step": 3, "explode": 1}]}, "events.json"),
    ({"nodes": 2, "initial_nodes": 1, "events": [{"at_step": 3, "lose": ["n0"]}]}, "anchor"),
])
def test_bad_events_script_is_one_line(tmp_path, never_runs, events, message):
    db = tmp_path / "job.db"
    result = CliRunner().invoke(cli, ["run", "--model", "tiny", "--global-batch", "8",
                                      "--events", _events(tmp_path, events), "--db", str(db),
                                      "--", "true"])
    assert result.exit_code == 2, result.output
    lines = [x for x in result.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("slurm-etc: error:"), result.output
    assert message in lines[0]
    assert not db.exists()


def test_unknown_model_is_one_line(never_runs):
    result = CliRunner().invoke(cli, ["run", "--model", "no-such-model", "--global-batch", "8",
                                      "--", "true"])
    assert result.exit_code == 2 and "Traceback" not in result.output


def test_events_that_never_fired_are_named(tmp_path):
    """A script whose events come after the workers' last step: the job finishes, and
    `run` says which events never happened (stderr, one line; --json: unfired_events)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    fake = Path(__file__).resolve().parents[2] / "bench" / "fake_worker.py"
    events = _events(tmp_path, {"nodes": 2, "gpus_per_node": 1, "initial_nodes": 1,
                                "events": [{"at_step": 2, "grant": ["n1"]},
                                           {"at_step": 900, "lose": ["n1"]}]})
    done = subprocess.run(
        [str(Path(sys.executable).with_name("slurm-etc")), "run", "--model", "tiny",
         "--global-batch", "8", "--events", events, "--db", str(tmp_path / "job.db"),
         "--state-dir", str(tmp_path / "state"), "--json", "--", sys.executable, str(fake)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "FAKE_STEPS": "6", "FAKE_STEP_S": "0.05"})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["state"] == "finished"
    assert out["unfired_events"] == ["event 2 at step 900: lose n1:0"], out
    warned = [ln for ln in done.stderr.splitlines() if "did not play out" in ln]
    assert len(warned) == 1 and "event 2 at step 900" in warned[0], done.stderr[-2000:]
    assert "event 1" not in warned[0]  # the grant came
