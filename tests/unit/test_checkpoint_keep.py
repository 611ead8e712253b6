"""Which periodic checkpoints stay (the newest K >= 1, only complete ones count) and how
`slurm-etc run --keep-checkpoints` reaches the workers: pure parts, no torch."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from slurm_etc.cli.main import cli
from slurm_etc.coordinator import run as run_module
from slurm_etc.plan.errors import ConfigError
from slurm_etc.protocol.recovery import (
    KEEP_CHECKPOINTS,
    RESUME_FROM,
    Recovery,
    checkpoint_steps,
    checkpoints_to_delete,
    newest_checkpoint,
)

pytestmark = pytest.mark.unit


def test_only_complete_checkpoints_count(tmp_path):
    for name in ("step-3", "step-48", "step-51.partial", "step-6.old", "latest", "step-x"):
        (tmp_path / name).mkdir()
    (tmp_path / "step-9").write_text("a file, not a checkpoint")
    assert checkpoint_steps(tmp_path) == [3, 48]
    assert newest_checkpoint(tmp_path) == 48
    assert newest_checkpoint(tmp_path / "missing") is None and checkpoint_steps(None) == []


@pytest.mark.parametrize("steps,keep,gone", [
    ([3, 48], 2, []),
    ([3, 6, 48], 2, [3]),
    ([48, 3, 51], 1, [3, 48]),  # the step-48 / step-3 case: the newest is never deleted
    ([7], 1, []),
    ([], 3, []),
])
def test_the_newest_k_stay(steps, keep, gone):
    assert checkpoints_to_delete(steps, keep) == gone
    if steps:
        assert max(steps) not in checkpoints_to_delete(steps, keep)


def test_keep_must_be_at_least_one():
    with pytest.raises(ConfigError, match="at least 1"):
        checkpoints_to_delete([1, 2], 0)
    with pytest.raises(ConfigError, match="at least 1"):
        Recovery(0, 2, "/ck", keep_checkpoints=0)


def test_keep_and_resume_travel_in_the_environment():
    r = Recovery(0, 4, "/ck", keep_checkpoints=5, resume_from="/ck/step-8")
    env = r.env()
    assert env[KEEP_CHECKPOINTS] == "5" and env[RESUME_FROM] == "/ck/step-8"
    assert Recovery.from_env(env, Recovery()) == r
    assert KEEP_CHECKPOINTS not in Recovery(0, 4, "/ck").env()  # the default sets nothing


def test_keep_checkpoints_option(tmp_path, monkeypatch):
    got: list = []
    monkeypatch.setattr(run_module, "run_job", lambda spec, *a, **k: got.append(spec) or
                        {"state": "finished"})
    base = ["run", "--model", "tiny", "--global-batch", "8", "--checkpoint-every", "3",
            "--checkpoint-dir", str(tmp_path / "ck")]
    bad = CliRunner().invoke(cli, [*base, "--keep-checkpoints", "0", "--", "true"])
    assert bad.exit_code == 2 and got == [], bad.output
    ok = CliRunner().invoke(cli, [*base, "--keep-checkpoints", "3", "--", "true"])
    assert ok.exit_code == 0, ok.output
    assert got[0].recovery.keep_checkpoints == 3


def test_reattach_wait_option(tmp_path, monkeypatch):
    """`--reattach-wait`: bounded (5 s .. 1 day), one line past the bound, and it reaches the
    job spec (the coordinator passes it to every worker as SLURM_ETC_REATTACH_WAIT_S)."""
    got: list = []
    monkeypatch.setattr(run_module, "run_job", lambda spec, *a, **k: got.append(spec) or
                        {"state": "finished"})
    base = ["run", "--model", "tiny", "--global-batch", "8"]
    for bad in ("1", "1e9", "soon"):
        out = CliRunner().invoke(cli, [*base, "--reattach-wait", bad, "--", "true"])
        lines = [x for x in out.output.splitlines() if x.strip()]
        assert out.exit_code == 2 and len(lines) == 1 and got == [], out.output
    ok = CliRunner().invoke(cli, [*base, "--reattach-wait", "30", "--", "true"])
    assert ok.exit_code == 0, ok.output
    assert got[0].reattach_wait_s == 30.0
