"""`slurm-etc run --hardware` / `--progress`: profiles and JSON figures reach the chooser;
bad values are one line, exit 2, and nothing is started or written."""
from __future__ import annotations

import json

import click
import pytest
from click.testing import CliRunner

from slurm_etc.alloc.chooser import Hardware, TrainingJob, choose_config
from slurm_etc.alloc.hardware import PROFILES
from slurm_etc.cli import cmd_run
from slurm_etc.cli.main import cli
from slurm_etc.coordinator import run as run_module
from slurm_etc.plan.model import PRESETS

TINY = TrainingJob(PRESETS["tiny"], 8, 1, False)


def test_cpu_profile_spreads_a_tiny_model_where_h100_does_not():
    """Why the option exists: on H100 figures `tiny` stays on one device of four."""
    on_h100 = choose_config(TINY, PROFILES["h100"], [2, 2]).config
    on_cpu = choose_config(TINY, PROFILES["cpu"], [2, 2]).config
    assert on_h100.world == 1 and on_cpu.world == 4, (on_h100, on_cpu)


@pytest.fixture
def captured(monkeypatch):
    """run_job replaced: the JobSpec (and progress callback) it would have been given."""
    seen: dict = {}

    def fake_run_job(spec, backend, topology, **kw):
        seen.update(spec=spec, **kw)
        if kw.get("progress"):
            kw["progress"]({"step": 1, "loss": 2.5, "layout": "dp=2", "generation": 0})
        return {"state": "finished"}
    monkeypatch.setattr(run_module, "run_job", fake_run_job)
    return seen


def _run(*args: str):
    return CliRunner().invoke(cli, ["run", "--model", "tiny", "--global-batch", "8",
                                    "--nodes", "2", "--gpus-per-node", "3", *args, "--", "true"])


def test_profile_file_and_env_reach_the_job(tmp_path, captured, monkeypatch):
    res = _run("--hardware", "cpu")
    assert res.exit_code == 0, res.output
    assert captured["spec"].hardware == Hardware(3, 2.0, 0.01, 10.0, 5.0, 0.5)
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"base": "cpu", "memory_gib": 4, "tflops": 0.5}))
    res = _run("--hardware", str(path))
    assert res.exit_code == 0, res.output
    assert captured["spec"].hardware == Hardware(3, 4.0, 0.5, 10.0, 5.0, 0.5)
    path.write_text(json.dumps({"memory_gib": 40}))  # base: h100
    monkeypatch.setenv("SLURM_ETC_RUN_HARDWARE", str(path))
    res = _run()
    assert res.exit_code == 0, res.output
    assert captured["spec"].hardware == Hardware(gpus_per_node=3, memory_gib=40.0)


def test_progress_lines(tmp_path, captured):
    out = tmp_path / "progress.jsonl"
    out.write_text('{"kept": 1}\n')
    res = _run("--progress", str(out))
    assert res.exit_code == 0, res.output
    first, line = [json.loads(x) for x in out.read_text().splitlines()]
    assert first == {"kept": 1}  # appended, not truncated
    assert line["step"] == 1 and line["loss"] == 2.5 and line["t"] > 1.6e9, line


@pytest.mark.parametrize("content,message", [
    (None, "not a profile (h100, cpu)"),
    ("[1", "not JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"memry_gib": 40}', "unknown field(s) 'memry_gib'"),
    ('{"base": "tpu"}', "base 'tpu' is not a profile"),
    ('{"tflops": 0}', "tflops must be a positive number"),
    ('{"tflops": true}', "tflops must be a positive number"),
    ('{"memory_gib": "80"}', "memory_gib must be a positive number"),
    ('{"memory_gib": 4, "reserved_gib": 6}', "reserved_gib (6) must be below"),
])
def test_bad_hardware_is_one_line(tmp_path, monkeypatch, content, message):
    monkeypatch.setattr(run_module, "run_job", lambda *a, **k: pytest.fail("started"))
    value = "h200x" if content is None else str(tmp_path / "hw.json")
    if content is not None:
        (tmp_path / "hw.json").write_text(content)
    progress = tmp_path / "progress.jsonl"
    res = _run("--hardware", value, "--progress", str(progress), "--db",
               str(tmp_path / "job.db"))
    assert res.exit_code == 2, res.output
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("slurm-etc: error: --hardware"), lines
    assert message in lines[0], lines
    assert not progress.exists() and not (tmp_path / "job.db").exists()


def test_unwritable_progress_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(run_module, "run_job", lambda *a, **k: pytest.fail("started"))
    res = _run("--progress", str(tmp_path / "missing" / "p.jsonl"))
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert "--progress" in res.output and "cannot append" in res.output
    assert cmd_run.open_progress(None) == (None, None)


def test_every_option_has_its_documented_environment_variable():
    """`SLURM_ETC_RUN_<OPTION>` (how scripts/elastic.sbatch passes options on): click derives
    the name from the parameter's name, which differs from the option's for some."""
    from slurm_etc.cli.cmd_run import run

    for p in run.params:
        if isinstance(p, click.Option):
            option = max(p.opts, key=len).lstrip("-").upper().replace("-", "_")
            assert (p.envvar or f"SLURM_ETC_RUN_{p.name.upper()}") == \
                f"SLURM_ETC_RUN_{option}", p.opts


def test_environment_variables_reach_the_job(tmp_path, captured, monkeypatch):
    out = tmp_path / "steps.jsonl"
    monkeypatch.setenv("SLURM_ETC_RUN_PROGRESS", str(out))
    monkeypatch.setenv("SLURM_ETC_RUN_TIMEOUT", "7.5")
    monkeypatch.setenv("SLURM_ETC_RUN_JSON", "1")
    monkeypatch.setenv("SLURM_ETC_RUN_NAME", "from-env")
    res = _run()
    assert res.exit_code == 0, res.output
    spec = captured["spec"]
    assert json.loads(res.output) == {"job": spec.job_id, "state": "finished"}
    assert spec.worker_timeout_s == 7.5 and spec.name == "from-env"
    assert json.loads(out.read_text())["step"] == 1
