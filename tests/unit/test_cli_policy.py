"""`slurm-etc policy`: reading is open to all, changing needs an admin (check injected)."""
import json

import pytest
from click.testing import CliRunner

from slurm_etc.cli.main import cli
from slurm_etc.policy.admin import AdminVerdict

pytestmark = pytest.mark.unit

ADMIN = {"admin_check": lambda: AdminVerdict(True, "Slurm Administrator")}
USER = {"admin_check": lambda: AdminVerdict(False, "alice has Slurm AdminLevel None; "
                                                   "changing policies needs root or a Slurm "
                                                   "Operator/Administrator")}


@pytest.fixture
def run(tmp_path):
    db = str(tmp_path / "etc.db")

    def invoke(args, obj=None, env=None):
        return CliRunner().invoke(cli, ["policy", "--db", db, *args], obj=dict(obj or {}),
                                  env=env)
    return invoke


def test_set_show_unset_round_trip(run):
    r = run(["set", "--partition", "gpu", "min_nodes=2", "allowed_tp=2,4,8", "grow=no",
             "--json"], ADMIN)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["policy"]["allowed_tp"] == [2, 4, 8]
    shown = json.loads(run(["show", "--json"]).stdout)["policies"]
    assert [p["scope"] for p in shown] == ["partition:gpu"] and shown[0]["grow"] is False
    table = run(["show", "--partition", "gpu"])
    assert "allowed_tp" in table.stdout and "2,4,8" in table.stdout
    r = run(["unset", "--partition", "gpu", "grow", "--json"], ADMIN)
    assert json.loads(r.stdout)["policy"]["grow"] is None
    r = run(["unset", "--partition", "gpu"], ADMIN)
    assert r.exit_code == 0 and "policy removed" in r.stderr
    assert "no policies set" in run(["show"]).stderr


def test_effective_policy_of_a_partition_and_account(run):
    run(["set", "--partition", "gpu", "max_nodes=32", "allowed_tp=2,4,8"], ADMIN)
    run(["set", "--account", "ml", "max_nodes=16", "allowed_tp=4,8,16"], ADMIN)
    out = json.loads(run(["show", "--partition", "gpu", "--account", "ml", "--json"]).stdout)
    assert out["effective"]["max_nodes"] == 16 and out["effective"]["allowed_tp"] == [4, 8]
    assert "effective" in run(["show", "--partition", "gpu", "--account", "ml"]).stdout


def test_non_admins_may_read_but_not_change(run):
    run(["set", "--partition", "gpu", "max_nodes=8"], ADMIN)
    r = run(["set", "--partition", "gpu", "max_nodes=64"], USER)
    assert r.exit_code == 2
    assert r.stderr.strip() == ("slurm-etc: error: permission denied: alice has Slurm "
                                "AdminLevel None; changing policies needs root or a Slurm "
                                "Operator/Administrator")
    assert run(["unset", "--partition", "gpu"], USER).exit_code == 2
    shown = json.loads(run(["show", "--json"], USER).stdout)["policies"]
    assert shown[0]["max_nodes"] == 8


@pytest.mark.parametrize("args, message", [
    (["set", "--partition", "gpu", "foo=1"], "unknown policy key 'foo'; valid keys:"),
    (["set", "--partition", "gpu", "min_nodes=0"], "min_nodes must be an integer >= 1"),
    (["set", "min_nodes=2"], "give the policy's scope: --partition NAME or --account NAME"),
    (["set", "--partition", "gpu", "--account", "ml", "grow=no"], "not both"),
    (["set", "--partition", "bad name", "grow=no"], "is not a Slurm name"),
    (["unset", "--account", "ml", "nope"], "unknown policy key 'nope'"),
    (["unset", "--account", "ml"], "account:ml has no policy"),
])
def test_bad_input_is_one_line_and_writes_nothing(run, args, message):
    r = run(args, ADMIN)
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in r.output
    assert json.loads(run(["show", "--json"]).stdout) == {"policies": []}


def test_invalid_merge_says_nothing_was_written(run):
    run(["set", "--partition", "gpu", "max_nodes=4"], ADMIN)
    r = run(["set", "--partition", "gpu", "min_nodes=8"], ADMIN)
    assert r.exit_code == 2 and "nothing was written" in r.stderr
    assert json.loads(run(["show", "--json"]).stdout)["policies"][0]["min_nodes"] is None


def test_database_path_from_the_environment(tmp_path):
    db = tmp_path / "env.db"
    r = CliRunner().invoke(cli, ["policy", "set", "--account", "ml", "grow=yes"],
                           obj=dict(ADMIN), env={"SLURM_ETC_DB": str(db)})
    assert r.exit_code == 0, r.output
    assert db.exists()


def test_the_default_admin_check_refuses_non_root_without_sacctmgr(tmp_path, monkeypatch):
    import slurm_etc.cli.cmd_policy as cmd

    monkeypatch.setattr(cmd.os, "getuid", lambda: 1000)
    monkeypatch.setattr(cmd.shutil, "which", lambda name: None)
    monkeypatch.setattr(cmd.getpass, "getuser", lambda: "alice")
    r = CliRunner().invoke(cli, ["policy", "--db", str(tmp_path / "x.db"), "set",
                                 "--account", "ml", "grow=yes"], obj={})
    assert r.exit_code == 2 and "sacctmgr unavailable" in r.stderr


def test_slurm_operators_may_change_policies(tmp_path, monkeypatch):
    import slurm_etc.cli.cmd_policy as cmd

    fake = tmp_path / "bin" / "sacctmgr"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho Operator\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:/usr/bin:/bin")
    monkeypatch.setattr(cmd.os, "getuid", lambda: 1000)
    verdict = cmd.slurm_admin_check()
    assert verdict.allowed and verdict.reason == "Slurm Operator"


def test_show_without_a_database_creates_none(tmp_path):
    db = tmp_path / "nested" / "etc.db"
    r = CliRunner().invoke(cli, ["policy", "--db", str(db), "show", "--json"], obj={})
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == {"policies": []}
    r = CliRunner().invoke(cli, ["policy", "--db", str(db), "show", "--partition", "gpu"],
                           obj={})
    assert r.exit_code == 0 and "no policy for partition:gpu" in r.output
    assert not db.exists() and not db.parent.exists()
