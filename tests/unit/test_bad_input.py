"""Bad input to every command: one line on stderr, non-zero exit, nothing written.

One table of cases, each a command line over a sandbox of bad files (missing, empty,
malformed JSON, wrong types, negative numbers; a corrupt, truncated, foreign, newer-schema
and locked SQLite file; unknown and invalid job ids) and the words the error must contain.
Every case runs in process (click's CliRunner: the same ``main`` as the installed entry
point) and checks: exit code 2, exactly one line on stderr starting ``slurm-etc: error:``,
no traceback, nothing on stdout, and every file of the sandbox (home, state directory,
temporary directory, working directory and the bad files themselves) unchanged, none added.
A few cases go through the real ``slurm-etc`` executable to show the same from outside.

The locked database is held by another process (``BEGIN EXCLUSIVE``): the command gives up
after a bounded wait (1 s here, ``BUSY_TIMEOUT_S`` = 10 s in the executable) with a line that
says the database is locked.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_etc.cli.main import cli
from slurm_etc.policy.admin import AdminVerdict
from slurm_etc.store import db as store_db
from slurm_etc.store import errors as store_errors

pytestmark = pytest.mark.unit

EXE = Path(sys.executable).with_name("slurm-etc")
ADMIN = {"admin_check": lambda: AdminVerdict(True, "Slurm Administrator", "admin")}
LOCK_WAIT_S = 1.0
MODEL = {"name": "m", "num_layers": 2, "hidden": 64, "ffn_hidden": 256, "num_heads": 4,
         "vocab_size": 256, "seq_length": 64, "param_dtype": "fp32"}


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every place a command could write to, and the bad files it is given."""
    box = tmp_path_factory.mktemp("bad-input")
    for sub in ("home", "state", "tmp", "cwd", "adir"):
        (box / sub).mkdir()
    good = box / "good.db"
    store_db.open_store(good).close()
    rng = random.Random(11)
    (box / "corrupt.db").write_bytes(store_db.SQLITE_MAGIC + rng.randbytes(8192))
    (box / "random.db").write_bytes(rng.randbytes(4096))
    (box / "truncated.db").write_bytes(good.read_bytes()[:1500])
    (box / "empty.db").write_bytes(b"")
    con = sqlite3.connect(box / "foreign.db")
    con.execute("CREATE TABLE accounts (id INTEGER PRIMARY KEY, name TEXT)")
    con.commit()
    con.close()
    for name, revision in (("newer.db", "9999_from_the_future"), ("locked.db", None)):
        shutil.copy(good, box / name)
        if revision:
            con = sqlite3.connect(box / name)
            con.execute("UPDATE alembic_version SET version_num = ?", (revision,))
            con.commit()
            con.close()
    files = {
        "empty.json": "",
        "bad.json": "{not json",
        "list.json": "[1, 2]",
        "string.json": '"tiny"',
        "model_unknown_field.json": json.dumps({"name": "m", "num_layers": 2, "hiden": 64}),
        "model_wrong_type.json": json.dumps({**MODEL, "num_layers": "two"}),
        "model_negative.json": json.dumps({**MODEL, "num_layers": -2}),
        "model_bool_not_bool.json": json.dumps({**MODEL, "swiglu": "yes"}),
        "model_groups_not_int.json": json.dumps({**MODEL, "num_query_groups": "x"}),
        "model_missing_field.json": json.dumps({"name": "m", "num_layers": 2}),
        "binary.json": "",
        "events_unknown_key.json": json.dumps({"nodes": 2, "gpus_per_node": 2, "events": [
            {"at_step": 2, "explode": ["n1"]}]}),
        "events_no_such_node.json": json.dumps({"nodes": 2, "gpus_per_node": 2, "events": [
            {"at_step": 2, "lose": ["n7"]}]}),
        "events_negative.json": json.dumps({"nodes": -2, "gpus_per_node": 2, "events": []}),
        "events_wrong_type.json": json.dumps({"nodes": 2, "gpus_per_node": 2, "events": [
            {"at_step": "soon", "grant": 1}]}),
        "trace_empty_object.json": "{}",
        "trace_null_nodes.json": json.dumps({"cluster": {"nodes": None}, "jobs": [],
                                             "events": []}),
        "model_newline_key.json": json.dumps({**MODEL, "hid\nden": 1}),
    }
    for name, text in files.items():
        (box / name).write_text(text)
    (box / "binary.json").write_bytes(b"\xff\xfe\x00garbage")
    # Another process holds the write lock of locked.db for the whole module.
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sqlite3, sys\n"
         f"c = sqlite3.connect({str(box / 'locked.db')!r}, isolation_level=None)\n"
         "c.execute('BEGIN EXCLUSIVE')\n"
         "print('locked', flush=True)\n"
         "sys.stdin.read()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    try:
        yield box
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=10)


def _env(box: Path) -> dict[str, str]:
    return {"HOME": str(box / "home"), "XDG_DATA_HOME": str(box / "home" / "share"),
            "SLURM_ETC_STATE_DIR": str(box / "state"), "TMPDIR": str(box / "tmp"),
            "SLURM_ETC_DB": "", "SLURM_JOB_ID": "", "SLURM_TMPDIR": "", "COLUMNS": "200"}


def _tree(box: Path) -> dict[str, tuple[str, int, int]]:
    """Every file and directory under ``box``: content hash, mtime and mode."""
    out = {}
    for path in sorted(box.rglob("*")):
        st = path.lstat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
        out[str(path.relative_to(box))] = (digest, st.st_mtime_ns, st.st_mode)
    return out


M = "{box}"  # placeholder for the sandbox in the table below
L = "--from dp=1,tp=1,pp=1 --to dp=2,tp=1,pp=1".split()
RUN = ["run", "--model", "tiny", "--global-batch", "8"]
WORKER = ["--", sys.executable, "-c", "pass"]

# (id, arguments, words the one error line contains)
CASES: list[tuple[str, list[str], str]] = [
    # --- status
    ("status-corrupt-db", ["status", "--db", f"{M}/corrupt.db"], "file is not a database"),
    ("status-random-bytes-db", ["status", "--db", f"{M}/random.db"], "not an SQLite database"),
    ("status-truncated-db", ["status", "--db", f"{M}/truncated.db"], "cannot read"),
    ("status-foreign-db", ["status", "--db", f"{M}/foreign.db"], "not a slurm-etc database"),
    ("status-newer-schema", ["status", "--db", f"{M}/newer.db"], "does not know"),
    ("status-locked-db", ["status", "--db", f"{M}/locked.db"], "database is locked"),
    ("status-missing-db", ["status", "--db", f"{M}/nope.db"], "no database at"),
    ("status-directory-db", ["status", "--db", f"{M}/adir"], "no database at"),
    ("status-unknown-job", ["status", "4242", "--db", f"{M}/good.db"], "no job 4242"),
    ("status-invalid-job-id", ["status", "../../etc/passwd", "--db", f"{M}/good.db"],
     "no job ../../etc/passwd"),
    ("status-unknown-job-state-dir", ["status", "4242"], "no job 4242"),
    ("status-state-dir-is-a-file", ["status", "--state-dir", f"{M}/bad.json"], "is a file"),
    ("status-watch-too-fast", ["status", "--watch", "0.01"], "--watch"),
    ("status-bad-url", ["status", "--db", "nosuchdb://u@h/x"], "unknown database kind"),
    # --- policy (writes need an admin: the verdict is injected so the value checks run)
    ("policy-negative", ["policy", "--db", f"{M}/good.db", "set", "--partition", "gpu",
                         "min_nodes=-2"], "min_nodes must be an integer >= 1"),
    ("policy-not-an-integer", ["policy", "--db", f"{M}/good.db", "set", "--partition", "gpu",
                               "max_nodes=lots"], "max_nodes must be an integer"),
    ("policy-unknown-key", ["policy", "--db", f"{M}/good.db", "set", "--partition", "gpu",
                            "max_gpus=3"], "unknown policy key 'max_gpus'"),
    ("policy-min-above-max", ["policy", "--db", f"{M}/good.db", "set", "--partition", "gpu",
                              "min_nodes=8", "max_nodes=2"], "must not exceed"),
    ("policy-bad-tp-list", ["policy", "--db", f"{M}/good.db", "set", "--partition", "gpu",
                            "allowed_tp=2,x"], "allowed_tp"),
    ("policy-bad-bool", ["policy", "--db", f"{M}/good.db", "set", "--partition", "gpu",
                         "grow=maybe"], "grow"),
    ("policy-no-scope", ["policy", "--db", f"{M}/good.db", "set", "min_nodes=1"],
     "--partition NAME or --account NAME"),
    ("policy-no-key-value", ["policy", "--db", f"{M}/good.db", "set", "--partition", "gpu",
                             "min_nodes"], "min_nodes"),
    ("policy-set-corrupt-db", ["policy", "--db", f"{M}/corrupt.db", "set", "--partition",
                               "gpu", "min_nodes=2"], "file is not a database"),
    ("policy-set-locked-db", ["policy", "--db", f"{M}/locked.db", "set", "--partition",
                              "gpu", "min_nodes=2"], "database is locked"),
    ("policy-set-foreign-db", ["policy", "--db", f"{M}/foreign.db", "set", "--partition",
                               "gpu", "min_nodes=2"], "not a slurm-etc database"),
    ("policy-set-newer-db", ["policy", "--db", f"{M}/newer.db", "set", "--partition", "gpu",
                             "min_nodes=2"], "does not know"),
    ("policy-show-truncated-db", ["policy", "--db", f"{M}/truncated.db", "show"],
     "database"),
    # --- plan: model files, layouts, numbers
    ("plan-model-missing", ["plan", "--model", f"{M}/nope.json", *L], "does not exist"),
    ("plan-model-empty", ["plan", "--model", f"{M}/empty.json", *L], "not valid JSON"),
    ("plan-model-malformed", ["plan", "--model", f"{M}/bad.json", *L], "not valid JSON"),
    ("plan-model-a-list", ["plan", "--model", f"{M}/list.json", *L], "JSON object"),
    ("plan-model-a-string", ["plan", "--model", f"{M}/string.json", *L], "JSON object"),
    ("plan-model-unknown-field", ["plan", "--model", f"{M}/model_unknown_field.json", *L],
     "hiden"),
    ("plan-model-wrong-type", ["plan", "--model", f"{M}/model_wrong_type.json", *L],
     "num_layers must be a positive integer, got 'two'"),
    ("plan-model-negative", ["plan", "--model", f"{M}/model_negative.json", *L],
     "num_layers must be a positive integer, got -2"),
    ("plan-model-bool-not-bool", ["plan", "--model", f"{M}/model_bool_not_bool.json", *L],
     "swiglu must be true or false"),
    ("plan-model-groups-not-int", ["plan", "--model", f"{M}/model_groups_not_int.json", *L],
     "num_query_groups"),
    ("plan-model-missing-fields", ["plan", "--model", f"{M}/model_missing_field.json", *L],
     "ffn_hidden"),
    ("plan-model-not-text", ["plan", "--model", f"{M}/binary.json", *L], "not text"),
    ("plan-model-newline-in-a-key", ["plan", "--model", f"{M}/model_newline_key.json", *L],
     "unknown model field(s) hid\\nden"),
    ("plan-model-directory", ["plan", "--model", f"{M}/adir", *L], "is a directory"),
    ("plan-unknown-preset", ["plan", "--model", "gpt-9", *L], "unknown model 'gpt-9'"),
    ("plan-negative-dp", ["plan", "--model", "tiny", "--from", "dp=-1", "--to", "dp=2"],
     "dp must be a positive integer"),
    ("plan-zero-dp", ["plan", "--model", "tiny", "--from", "dp=0", "--to", "dp=2"],
     "dp must be a positive integer"),
    ("plan-fractional-dp", ["plan", "--model", "tiny", "--from", "dp=1.5", "--to", "dp=2"],
     "dp=1.5"),
    ("plan-layout-garbage", ["plan", "--model", "tiny", "--from", "lots", "--to", "dp=2"],
     "cannot parse 'lots'"),
    ("plan-tp-not-dividing", ["plan", "--model", "tiny", "--from", "dp=1,tp=3",
                              "--to", "dp=2"], "must divide"),
    ("plan-drop-nodes-garbage", ["plan", "--model", "tiny", *L, "--drop-nodes", "x-"],
     "--drop-nodes"),
    ("plan-drop-nodes-huge-range", ["plan", "--model", "tiny", *L, "--drop-nodes",
                                    "0-9223372036854775807"], "not a range of node indices"),
    ("plan-gpus-per-node-negative", ["plan", "--model", "tiny", *L, "--gpus-per-node", "-1"],
     "--gpus-per-node"),
    ("plan-bandwidth-zero", ["plan", "--model", "tiny", *L, "--inter-node-gbps", "0"],
     "--inter-node-gbps"),
    ("plan-missing-option", ["plan", "--model", "tiny", "--from", "dp=1"], "--to"),
    # --- simulate: trace files, options
    ("simulate-trace-missing", ["simulate", "--trace", f"{M}/nope.json"], "nope.json"),
    ("simulate-trace-malformed", ["simulate", "--trace", f"{M}/bad.json"], "not valid JSON"),
    ("simulate-trace-empty", ["simulate", "--trace", f"{M}/empty.json"], "not valid JSON"),
    ("simulate-trace-a-list", ["simulate", "--trace", f"{M}/list.json"], "JSON object"),
    ("simulate-trace-no-fields", ["simulate", "--trace", f"{M}/trace_empty_object.json"],
     "trace_empty_object.json"),
    ("simulate-trace-null-nodes", ["simulate", "--trace", f"{M}/trace_null_nodes.json"],
     "nodes must be an integer, got None"),
    ("simulate-trace-directory", ["simulate", "--trace", f"{M}/adir"], "is a directory"),
    ("simulate-neither", ["simulate"], "--trace FILE, --synthetic or --sacct FILE"),
    ("simulate-both", ["simulate", "--synthetic", "--trace", f"{M}/bad.json"],
     "--trace FILE, --synthetic or --sacct FILE"),
    ("simulate-negative-nodes", ["simulate", "--synthetic", "--nodes", "-3"], "--nodes"),
    ("simulate-negative-hours", ["simulate", "--synthetic", "--hours", "-1"], "--hours"),
    # sizes past their bound and control characters (the whole class is walked in
    # test_bounds_property.py; these keep one of each in this table)
    ("simulate-nodes-past-bound", ["simulate", "--synthetic", "--nodes", "100000000"],
     "exceeds the bound of 16,384 nodes"),
    ("plan-add-nodes-past-bound", ["plan", "--model", "tiny", *L, "--add-nodes",
                                   "100000000000"], "--add-nodes"),
    ("run-nodes-x-gpus-past-bound", ["run", "--nodes", "16384", "--gpus-per-node", "1024",
                                     "--model", "tiny", "--global-batch", "8", *WORKER],
     "1,024 local processes"),
    ("run-name-control-character", [*RUN, "--name", "a\x1b[2Jb", *WORKER], "U+001B"),
    ("policy-value-past-bound", ["policy", "--db", f"{M}/good.db", "set", "--partition", "gpu",
                                 "max_nodes=100000000000000000000"], "max_nodes"),
    # --- verify
    ("verify-no-layouts", ["verify", "--model", "tiny"], "--from and --to"),
    ("verify-model-malformed", ["verify", "--model", f"{M}/bad.json", *L], "not valid JSON"),
    ("verify-too-many-processes", ["verify", "--model", "tiny", "--from", "dp=1",
                                   "--to", "dp=99"], "--max-processes"),
    ("verify-sequence-garbage", ["verify", "--model", "tiny", "--sequence",
                                 "dp=1 -> banana"], "cannot parse 'banana'"),
    ("verify-zero-steps", ["verify", "--model", "tiny", *L, "--steps", "0"], "--steps"),
    # --- bench
    ("bench-model-malformed", ["bench", "migrate", "--model", f"{M}/bad.json", *L],
     "not valid JSON"),
    ("bench-missing-layout", ["bench", "migrate", "--model", "tiny"], "--from"),
    ("bench-unknown-option", ["bench", "migrate", "--bogus"], "--bogus"),
    ("bench-unknown-benchmark", ["bench", "nosuch"], "nosuch"),
    ("bench-moe-tp", ["bench", "migrate", "--model", "tiny-moe", "--from", "dp=2,ep=2",
                      "--to", "dp=2,tp=2"], "needs Transformer Engine"),
    ("bench-cp", ["bench", "migrate", "--model", "tiny", "--from", "dp=2",
                  "--to", "dp=1,cp=2"], "cp (2) needs Transformer Engine"),
    # --- run: events scripts, model, record databases, job ids, numbers
    ("run-events-malformed", [*RUN, "--events", f"{M}/bad.json", *WORKER], "not valid JSON"),
    ("run-events-empty", [*RUN, "--events", f"{M}/empty.json", *WORKER], "not valid JSON"),
    ("run-events-a-list", [*RUN, "--events", f"{M}/list.json", *WORKER], "object"),
    ("run-events-unknown-key", [*RUN, "--events", f"{M}/events_unknown_key.json", *WORKER],
     "explode"),
    ("run-events-no-such-node", [*RUN, "--events", f"{M}/events_no_such_node.json",
                                 *WORKER], "n7"),
    ("run-events-negative-nodes", [*RUN, "--events", f"{M}/events_negative.json", *WORKER],
     "nodes"),
    ("run-events-wrong-type", [*RUN, "--events", f"{M}/events_wrong_type.json", *WORKER],
     "at_step"),
    ("run-events-missing", [*RUN, "--events", f"{M}/nope.json", *WORKER], "nope.json"),
    ("run-model-malformed", ["run", "--model", f"{M}/bad.json", "--global-batch", "8",
                             *WORKER], "not valid JSON"),
    ("run-db-corrupt", [*RUN, "--job-id", "j1", "--db", f"{M}/corrupt.db", *WORKER],
     "file is not a database"),
    ("run-db-foreign", [*RUN, "--job-id", "j1", "--db", f"{M}/foreign.db", *WORKER],
     "not a slurm-etc database"),
    ("run-db-newer-schema", [*RUN, "--job-id", "j1", "--db", f"{M}/newer.db", *WORKER],
     "does not know"),
    ("run-db-locked", [*RUN, "--job-id", "j1", "--db", f"{M}/locked.db", *WORKER],
     "database is locked"),
    ("run-policy-db-corrupt", [*RUN, "--job-id", "j1", "--policy-db", f"{M}/corrupt.db",
                               *WORKER], "file is not a database"),
    ("run-job-id-path", [*RUN, "--job-id", "../../x", *WORKER], "job id"),
    ("run-bind-not-an-address", [*RUN, "--bind", "999.1.1.1", *WORKER],
     "--bind '999.1.1.1' is not an address"),
    ("run-bind-not-this-host", [*RUN, "--bind", "192.0.2.1", *WORKER],
     "--bind 192.0.2.1: cannot listen there"),
    ("run-advertise-unresolvable", [*RUN, "--bind", "0.0.0.0", "--advertise",
                                    "no-such-host.invalid", *WORKER], "does not resolve"),
    ("run-zero-batch", ["run", "--model", "tiny", "--global-batch", "0", *WORKER],
     "--global-batch"),
    ("run-no-worker-command", RUN, "COMMAND"),
    ("run-unknown-backend", [*RUN, "--backend", "kubernetes", *WORKER], "--backend"),
    # --- demo
    ("demo-inject-nowhere", ["demo", "--inject", "nowhere"], "unknown phase 'nowhere'"),
    ("demo-model-malformed", ["demo", "--model", f"{M}/bad.json"], "not valid JSON"),
    ("demo-db-exists", ["demo", "--db", f"{M}/good.db", "--out", f"{M}/cwd/demo-out"],
     "already exists"),
    ("demo-too-few-steps", ["demo", "--steps", "3"], "--steps"),
    ("soak-negative-events", ["soak", "--events", "-1"], "--events"),
    ("soak-events-past-bound", ["soak", "--events", "10001"], "--events"),
    ("soak-seed-not-a-number", ["soak", "--seed", "x"], "--seed"),
    # --- the command line itself
    ("unknown-command", ["launch"], "No such command 'launch'"),
    ("unknown-global-option", ["--frobnicate", "status"], "--frobnicate"),
]


def _args(box: Path, args: list[str]) -> list[str]:
    return [a.replace(M, str(box)) for a in args]


def _assert_one_line(stderr: str, words: str, box: Path) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{stderr}"
    line = lines[0]
    assert line.startswith("slurm-etc: error: "), line
    assert "Traceback" not in stderr and "Error:" not in line.removeprefix("slurm-etc: error: ")
    assert words.replace(M, str(box)) in line, f"{words!r} not in {line!r}"
    return line


@pytest.mark.parametrize(("args", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_nothing_written(
        sandbox: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], words: str) -> None:
    monkeypatch.setattr(store_db, "BUSY_TIMEOUT_S", LOCK_WAIT_S)  # the wait
    monkeypatch.setattr(store_errors, "BUSY_TIMEOUT_S", LOCK_WAIT_S)  # the hint's words
    monkeypatch.chdir(sandbox / "cwd")
    before = _tree(sandbox)
    started = time.monotonic()
    r = CliRunner().invoke(cli, _args(sandbox, args), obj=dict(ADMIN), env=_env(sandbox))
    took = time.monotonic() - started
    assert r.exception is None or isinstance(r.exception, SystemExit), (
        f"{type(r.exception).__name__} escaped: {r.exception}\n{r.stderr}")
    assert r.exit_code == 2, (r.exit_code, r.stderr, r.stdout)
    _assert_one_line(r.stderr, words, sandbox)
    assert r.stdout == ""
    assert _tree(sandbox) == before, "a bad input changed or created files"
    assert took < LOCK_WAIT_S + 5, f"took {took:.1f} s"


def test_the_table_covers_every_command() -> None:
    commands = set(cli.commands)  # type: ignore[attr-defined]
    tried = {c[1][0] for c in CASES}
    assert commands <= tried, f"no bad input tried for {sorted(commands - tried)}"


def test_the_checker_catches_a_traceback_and_a_second_line(sandbox: Path) -> None:
    """The assertions above fail on what they guard against (planted outputs)."""
    for planted in ("Traceback (most recent call last):\n  File ...\nValueError: x",
                    "slurm-etc: error: bad thing\nmore",
                    "Usage: slurm-etc plan\nError: Invalid value",
                    "slurm-etc: error: something else entirely"):
        with pytest.raises(AssertionError):
            _assert_one_line(planted, "bad thing", sandbox)
    before = _tree(sandbox)
    (sandbox / "cwd" / "planted").write_text("x")
    try:
        assert _tree(sandbox) != before
    finally:
        (sandbox / "cwd" / "planted").unlink()
    os.utime(sandbox / "good.db", ns=(0, 0))
    try:
        assert _tree(sandbox) != before
    finally:
        os.utime(sandbox / "good.db")


# The real entry point: same one line, no traceback, exit 2, for a few of the cases; the
# locked database with the executable's own bound (BUSY_TIMEOUT_S).
EXE_CASES = ["status-corrupt-db", "plan-model-malformed", "run-db-corrupt",
             "run-events-no-such-node", "plan-gpus-per-node-negative", "policy-set-newer-db",
             "status-locked-db"]


@pytest.mark.parametrize("case", EXE_CASES)
def test_the_installed_command_says_the_same(sandbox: Path, case: str) -> None:
    args, words = next((a, w) for i, a, w in CASES if i == case)
    assert EXE.is_file(), f"{EXE} is missing: pip install -e . in the venv"
    before = _tree(sandbox)
    started = time.monotonic()
    proc = subprocess.run([str(EXE), *_args(sandbox, args)], capture_output=True, text=True,
                          env={**os.environ, **_env(sandbox)}, cwd=sandbox / "cwd",
                          timeout=store_db.BUSY_TIMEOUT_S + 30)
    took = time.monotonic() - started
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    line = _assert_one_line(proc.stderr, words, sandbox)
    assert proc.stdout == ""
    assert _tree(sandbox) == before
    if case == "status-locked-db":
        assert store_db.BUSY_TIMEOUT_S - 1 <= took <= store_db.BUSY_TIMEOUT_S + 20, took
        assert f"{store_db.BUSY_TIMEOUT_S:g} s" in line
