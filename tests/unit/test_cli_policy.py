"""`slurm-etc policy`: reading is open to all, changing needs an admin.

Most tests inject the verdict; the admin check itself runs against a fake ``sacctmgr`` that
records which user it was asked about and grants Administrator only to ``admin``, with the
real uid's name faked through ``pwd`` (and once through a real second user, forked).
"""
import json
import os
import pwd
import shutil
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_etc.cli.main import cli
from slurm_etc.policy.admin import AdminVerdict
from tests.unit.second_user import as_user, local_user

pytestmark = pytest.mark.unit

ADMIN = {"admin_check": lambda: AdminVerdict(True, "Slurm Administrator", "admin")}
USER = {"admin_check": lambda: AdminVerdict(False, "alice has Slurm AdminLevel None; "
                                                   "changing policies needs root or a Slurm "
                                                   "Operator/Administrator", "alice")}


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


# ---- the admin check itself: identity from the real uid, sacctmgr asked about it --------

REFUSED_ALICE = ("slurm-etc: error: permission denied: alice has Slurm AdminLevel None; "
                 "changing policies needs root or a Slurm Operator/Administrator")


def _write_fake_sacctmgr(directory, log, body=None):
    """A sacctmgr that logs the user it is asked about (``-nP show user U ...``) and grants
    Administrator to ``admin`` only."""
    directory.mkdir(parents=True, exist_ok=True)
    fake = directory / "sacctmgr"
    fake.write_text(body or f"""#!/bin/sh
echo "$4" >> {log}
if [ "$4" = admin ]; then echo "$4|Administrator"; else echo "$4|None"; fi
""")
    fake.chmod(0o755)
    return fake


@pytest.fixture
def sacctmgr(tmp_path, monkeypatch):
    """The fake as the only sacctmgr the check looks for; ``asked()``: users asked about."""
    import slurm_etc.cli.cmd_policy as cmd

    log = tmp_path / "asked.log"
    fake = _write_fake_sacctmgr(tmp_path / "sbin", log)
    monkeypatch.setattr(cmd, "SACCTMGR_DIRS", (str(fake.parent),))

    class Fake:
        path = fake

        @staticmethod
        def asked():
            return log.read_text().split() if log.exists() else []
    return Fake


def _real_user(monkeypatch, uid, name):
    """Fake the process's real uid and its passwd entry (name None: no entry)."""
    import slurm_etc.cli.cmd_policy as cmd

    def getpwuid(u):
        if u == uid and name is not None:
            return pwd.struct_passwd((name, "x", uid, uid, "", "/nonexistent", "/bin/sh"))
        raise KeyError(f"getpwuid(): uid not found: {u}")
    monkeypatch.setattr(cmd.os, "getuid", lambda: uid)
    monkeypatch.setattr(cmd.pwd, "getpwuid", getpwuid)


SPOOF = {"LOGNAME": "admin", "USER": "admin", "LNAME": "admin", "USERNAME": "admin"}


def test_logname_spoofing_an_admin_is_refused(run, sacctmgr, monkeypatch):
    """alice (uid 1000) claims to be admin through the environment: refused, and sacctmgr
    was asked about alice, not admin."""
    import getpass

    _real_user(monkeypatch, 1000, "alice")
    for key, value in SPOOF.items():
        monkeypatch.setenv(key, value)
    assert getpass.getuser() == "admin"  # what the environment claims
    r = run(["set", "--partition", "gpu", "max_nodes=64"], env=SPOOF)
    assert r.exit_code == 2
    assert r.stderr.strip() == REFUSED_ALICE
    assert sacctmgr.asked() == ["alice"]
    assert run(["unset", "--partition", "gpu"], env=SPOOF).exit_code == 2
    assert json.loads(run(["show", "--json"]).stdout) == {"policies": []}


def test_an_admin_is_recorded_by_the_name_of_the_real_uid(run, sacctmgr, monkeypatch):
    _real_user(monkeypatch, 1001, "admin")
    env = {"LOGNAME": "mallory", "USER": "mallory"}
    r = run(["set", "--partition", "gpu", "max_nodes=8", "--json"], env=env)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["policy"]["updated_by"] == "admin"
    assert sacctmgr.asked() == ["admin"]
    assert json.loads(run(["show", "--json"]).stdout)["policies"][0]["updated_by"] == "admin"


def test_root_needs_no_sacctmgr(run, sacctmgr, monkeypatch):
    _real_user(monkeypatch, 0, "root")
    r = run(["set", "--account", "ml", "grow=yes", "--json"], env=SPOOF)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["policy"]["updated_by"] == "root"
    assert sacctmgr.asked() == []


@pytest.mark.parametrize("body, problem", [
    ('#!/bin/sh\necho "sacctmgr: error: Problem talking to the database" >&2\nexit 1\n',
     "exited with code 1: sacctmgr: error: Problem talking to the database)"),
    ("#!/bin/sh\nexec sleep 30\n", "timed out after 0.5 s)"),
    ("#!/bin/sh\necho 'admin|Administrator'\n", "alice has Slurm AdminLevel no accounting record"),
])
def test_sacctmgr_failure_or_timeout_denies_in_one_line(run, sacctmgr, monkeypatch, body,
                                                        problem):
    import slurm_etc.cli.cmd_policy as cmd

    _write_fake_sacctmgr(sacctmgr.path.parent, "/dev/null", body)
    monkeypatch.setattr(cmd, "SACCTMGR_TIMEOUT_S", 0.5)
    _real_user(monkeypatch, 1000, "alice")
    r = run(["set", "--partition", "gpu", "max_nodes=64"], env=SPOOF)
    assert r.exit_code == 2 and "Traceback" not in r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("slurm-etc: error: permission denied: alice")
    assert lines[0].endswith(problem) or problem in lines[0], lines[0]
    assert json.loads(run(["show", "--json"]).stdout) == {"policies": []}


def test_a_sacctmgr_on_path_is_not_trusted(run, tmp_path, monkeypatch):
    """A "sacctmgr" the caller puts on PATH is never run: only the system directories are
    searched."""
    import slurm_etc.cli.cmd_policy as cmd

    log = tmp_path / "path-fake.log"
    planted = _write_fake_sacctmgr(tmp_path / "mine", log,
                                   f'#!/bin/sh\necho "$4" >> {log}\necho "$4|Administrator"\n')
    monkeypatch.setenv("PATH", f"{planted.parent}:{os.environ['PATH']}")
    monkeypatch.setattr(cmd, "SACCTMGR_DIRS", (str(tmp_path / "empty"),))
    _real_user(monkeypatch, 1000, "alice")
    r = run(["set", "--partition", "gpu", "max_nodes=64"])
    assert r.exit_code == 2
    assert r.stderr.strip().endswith(f"(sacctmgr not found in {tmp_path / 'empty'}); only root "
                                     "may change policies")
    assert not log.exists()


def test_a_uid_without_a_name_is_refused(run, sacctmgr, monkeypatch):
    _real_user(monkeypatch, 4242, None)
    r = run(["set", "--partition", "gpu", "max_nodes=64"], env=SPOOF)
    assert r.exit_code == 2
    assert r.stderr.strip() == ("slurm-etc: error: permission denied: uid 4242 has no user "
                                "name in the password database; only root may change policies")
    assert sacctmgr.asked() == []


def _traversable_tmp():
    """A temporary directory whose every ancestor others may enter (the second user must
    reach the fake sacctmgr), or None."""
    import stat

    for base in (tempfile.gettempdir(), "/var/tmp", "/tmp", "/dev/shm"):
        path, ok = Path(base).resolve(), True
        for p in (path, *path.parents):
            try:
                ok = ok and bool(p.stat().st_mode & stat.S_IXOTH)
            except OSError:
                ok = False
        if ok and os.access(path, os.W_OK):
            return str(path)
    return None


def _spoof(db, sacctmgr_dir):
    """Run by the second user: claim to be admin, run ``policy set``."""
    import slurm_etc.cli.cmd_policy as cmd

    cmd.SACCTMGR_DIRS = (sacctmgr_dir,)
    os.environ.update(SPOOF)
    r = CliRunner().invoke(cli, ["policy", "--db", db, "set", "--partition", "gpu",
                                 "max_nodes=64"], obj={}, env=SPOOF)
    return {"exit_code": r.exit_code, "stderr": r.stderr}


def test_a_real_second_user_spoofing_admin_is_refused():
    """A real local user (created here, removed after) runs ``policy set`` with
    LOGNAME=USER=admin: refused under its own name; sacctmgr was asked about it."""
    base = _traversable_tmp()
    if base is None:
        pytest.fail("no temporary directory that another user can reach (/tmp, /var/tmp "
                    "and /dev/shm are not traversable by others)")
    name = f"slurmetc-t{os.getpid()}"
    work = tempfile.mkdtemp(prefix="slurm-etc-spoof-", dir=base)
    try:
        with local_user(name) as entry:
            os.chmod(work, 0o777)
            log = os.path.join(work, "asked.log")
            fake = _write_fake_sacctmgr(Path(work) / "sbin", log)
            os.chmod(fake.parent, 0o755)
            # load what the child runs while the interpreter's files are still readable
            CliRunner().invoke(cli, ["policy", "--db", os.path.join(work, "warm.db"), "set",
                                     "--partition", "gpu", "max_nodes=1"], obj=dict(USER))
            import slurm_etc.cli.cmd_policy as cmd
            cmd.ask_sacctmgr("nobody-at-all")
            out = as_user(entry, lambda: _spoof(os.path.join(work, "etc.db"),
                                                str(fake.parent)))
            assert out["exit_code"] == 2
            assert out["stderr"].strip() == (
                f"slurm-etc: error: permission denied: {name} has Slurm AdminLevel None; "
                "changing policies needs root or a Slurm Operator/Administrator")
            with open(log) as f:
                assert f.read().split() == [name]
            assert not os.path.exists(os.path.join(work, "etc.db"))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_show_without_a_database_creates_none(tmp_path):
    db = tmp_path / "nested" / "etc.db"
    r = CliRunner().invoke(cli, ["policy", "--db", str(db), "show", "--json"], obj={})
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == {"policies": []}
    r = CliRunner().invoke(cli, ["policy", "--db", str(db), "show", "--partition", "gpu"],
                           obj={})
    assert r.exit_code == 0 and "no policy for partition:gpu" in r.output
    assert not db.exists() and not db.parent.exists()
