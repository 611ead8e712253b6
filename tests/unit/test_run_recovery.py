"""`slurm-etc run --peer-copy-every / --checkpoint-every / --checkpoint-dir` (and their
SLURM_ETC_RUN_* variables): bad values are one line, exit 2, nothing started or written; good
ones reach the job spec and, through the environment, the workers' trainer settings."""
from __future__ import annotations

import os
import signal

import pytest
from click.testing import CliRunner

from slurm_etc.cli.main import cli
from slurm_etc.coordinator import run as run_module
from slurm_etc.plan.errors import ConfigError
from slurm_etc.protocol.recovery import (
    AUTO,
    CHECKPOINT_DIR,
    CHECKPOINT_EVERY,
    PEER_COPY_EVERY,
    Recovery,
)

pytestmark = pytest.mark.unit

BASE = ["run", "--model", "tiny", "--global-batch", "8", "--nodes", "2"]


@pytest.fixture
def captured(monkeypatch):
    """run_job replaced: the spec it would have run, or an error if it was reached."""
    got: list = []

    def fake(spec, *_a, **_k):
        got.append(spec)
        return {"state": "finished"}
    monkeypatch.setattr(run_module, "run_job", fake)
    return got


@pytest.mark.parametrize("args,env,says", [
    (["--peer-copy-every", "-1"], {}, "--peer-copy-every"),
    (["--checkpoint-every", "5"], {}, "need a checkpoint directory (--checkpoint-dir)"),
    (["--peer-copy-every", "0", "--checkpoint-dir", "{tmp}/ck"], {},
     "without --checkpoint-every"),
    (["--checkpoint-every", "2", "--checkpoint-dir", "{tmp}/file/ck"], {},
     "cannot create it"),
    ([], {"SLURM_ETC_RUN_PEER_COPY_EVERY": "often"}, "'often' is not an integer"),
    (["--peer-copy-every", "AUTO2"], {}, "'AUTO2' is not an integer"),
])
def test_bad_recovery_options_are_one_line(tmp_path, captured, monkeypatch, args, env, says):
    (tmp_path / "file").write_text("not a directory")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    db = tmp_path / "job.db"
    argv = [*BASE, *(a.format(tmp=tmp_path) for a in args), "--db", str(db), "--", "true"]
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 2, result.output
    lines = [x for x in result.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("slurm-etc: error:"), result.output
    assert says in lines[0], lines[0]
    assert captured == [] and not db.exists() and not (tmp_path / "ck").exists()


def test_options_and_variables_reach_the_spec_and_the_workers_env(tmp_path, captured,
                                                                 monkeypatch):
    monkeypatch.setenv("SLURM_ETC_RUN_CHECKPOINT_EVERY", "6")
    ck = tmp_path / "shared" / "ckpt"
    result = CliRunner().invoke(cli, [*BASE, "--peer-copy-every", "3", "--checkpoint-dir",
                                      str(ck), "--", "true"])
    assert result.exit_code == 0, result.output
    (spec,) = captured
    assert spec.recovery == Recovery(3, 6, str(ck))
    assert ck.is_dir() and (ck.stat().st_mode & 0o777) == 0o700
    env = spec.recovery.env()
    assert env == {PEER_COPY_EVERY: "3", CHECKPOINT_EVERY: "6", CHECKPOINT_DIR: str(ck)}
    # a worker's trainer takes them over its own settings; unset ones keep the trainer's
    assert Recovery.from_env(env, Recovery(0, 0, None)) == Recovery(3, 6, str(ck))
    assert Recovery.from_env({}, Recovery(5, 0, None)) == Recovery(5, 0, None)


def test_default_is_auto_and_reaches_the_workers(captured):
    """Peer copies are on by default: ``auto`` (the workers choose the interval); 0 turns
    them off, and says so to workers whose trainer's own default is auto."""
    result = CliRunner().invoke(cli, [*BASE, "--", "true"])
    assert result.exit_code == 0, result.output
    (spec,) = captured
    assert spec.recovery.peer_copy_every == AUTO and spec.recovery.enabled
    assert spec.recovery.env() == {PEER_COPY_EVERY: "auto"}
    assert Recovery.from_env(spec.recovery.env(), Recovery()).peer_copy_every == AUTO
    # a training script that fixed its own interval keeps it under the run's default
    assert Recovery.from_env(spec.recovery.env(), Recovery(7, 0, None)).peer_copy_every == 7
    result = CliRunner().invoke(cli, [*BASE, "--peer-copy-every", "0", "--", "true"])
    assert result.exit_code == 0, result.output
    off = captured[-1].recovery
    assert not off.enabled and off.env() == {PEER_COPY_EVERY: "0"}
    assert Recovery.from_env(off.env(), Recovery()).peer_copy_every == 0


def test_auto_with_a_checkpoint_directory_alone(tmp_path, captured, monkeypatch):
    """--checkpoint-dir without --checkpoint-every: where auto copies that do not fit host
    memory fall back to (the workers choose that interval too)."""
    monkeypatch.setenv("SLURM_ETC_RUN_PEER_COPY_EVERY", "auto")
    ck = tmp_path / "ck"
    result = CliRunner().invoke(cli, [*BASE, "--checkpoint-dir", str(ck), "--", "true"])
    assert result.exit_code == 0, result.output
    (spec,) = captured
    assert spec.recovery == Recovery(AUTO, 0, str(ck))
    assert spec.recovery.env() == {PEER_COPY_EVERY: "auto", CHECKPOINT_DIR: str(ck)}


@pytest.mark.parametrize("env,says", [
    ({PEER_COPY_EVERY: "x"}, "SLURM_ETC_PEER_COPY_EVERY='x'"),
    ({CHECKPOINT_EVERY: "-2", CHECKPOINT_DIR: "/tmp"}, "must be >= 0"),
    ({CHECKPOINT_EVERY: "2"}, "need a checkpoint directory"),
])
def test_a_bad_worker_environment_is_named(env, says):
    with pytest.raises(ConfigError, match=says):
        Recovery.from_env(env, Recovery())


def test_run_worker_applies_the_environment_before_joining(monkeypatch):
    """entry.run_worker sets the trainer's settings from the environment first (the
    channel is never reached here: its absence stops the worker after that)."""
    from slurm_etc.protocol.channel import ChannelError
    from slurm_etc.worker import entry

    class Trainer:
        recovery = Recovery(1, 0, None)

    trainer = Trainer()
    env = {PEER_COPY_EVERY: "4", CHECKPOINT_EVERY: "8", CHECKPOINT_DIR: os.sep + "ck"}
    before = signal.getsignal(signal.SIGUSR2)
    try:
        with pytest.raises(ChannelError, match="not launched as a slurm-etc worker"):
            entry.run_worker(trainer, env)  # type: ignore[arg-type]
    finally:
        signal.signal(signal.SIGUSR2, before)
    assert trainer.recovery == Recovery(4, 8, os.sep + "ck")
