"""`slurm-etc plan` through click's CliRunner: JSON contract and one-line user errors."""
import json

import pytest
from click.testing import CliRunner

from slurm_etc.cli.main import cli
from slurm_etc.plan import PRESETS
from tests.unit.plan_helpers import make_plan

KEYS = {"total_state_bytes", "kept_bytes", "moved_bytes", "moved_intra_node_bytes",
        "moved_inter_node_bytes", "lower_bound_moved_bytes", "naive_moved_bytes", "messages",
        "rounds", "est_seconds", "lower_bound_seconds", "plan_seconds"}


def run(*args):
    return CliRunner().invoke(cli, ["plan", *args])


def test_json_has_the_promised_fields():
    r = run("--model", "tiny", "--from", "dp=4,tp=2,pp=2", "--to", "dp=3,tp=2,pp=2",
            "--gpus-per-node", "4", "--distributed-optimizer", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert KEYS <= out.keys()
    # the command prints the library's plan of the same transition, nothing else
    want = make_plan(PRESETS["tiny"], (4, 2, 2), (3, 2, 2), dist=True, gpn=4).summary()
    assert out.pop("plan_seconds") > 0 and want.pop("plan_seconds") > 0
    assert out == want
    assert out["kept_bytes"] + out["moved_bytes"] == out["needed_bytes"]
    assert out["moved_bytes"] == out["moved_intra_node_bytes"] + out["moved_inter_node_bytes"]
    # a dp shrink in the dense regime: the plan meets the byte lower bound exactly
    assert out["lower_bound_exact"] and out["moved_bytes"] == out["lower_bound_moved_bytes"]


def test_human_table():
    r = run("--model", "tiny", "--from", "dp=2,tp=2", "--to", "dp=1,tp=2,pp=2")
    assert r.exit_code == 0, r.output
    for label in ("kept in place", "byte lower bound", "messages / rounds", "planning time"):
        assert label in r.stdout


def test_drop_and_add_nodes():
    r = run("--model", "tiny", "--from", "dp=2,tp=2,pp=2", "--to", "dp=1,tp=2,pp=2",
            "--gpus-per-node", "2", "--drop-nodes", "1,3", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["moved_bytes"] == 0
    r = run("--model", "tiny", "--from", "dp=1,tp=2", "--to", "dp=2,tp=2", "--gpus-per-node",
            "2", "--add-nodes", "1", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["new_devices"] == 4


@pytest.mark.parametrize("args, message", [
    (["--model", "nope", "--from", "dp=1", "--to", "dp=2"], "unknown model 'nope'"),
    (["--model", "tiny", "--from", "dp=1,tp=3", "--to", "dp=2"], "tp (3) must divide"),
    (["--model", "tiny", "--from", "dp=x", "--to", "dp=2"], "dp must be an integer"),
    (["--model", "tiny", "--from", "dp=2", "--to", "dp=4", "--add-nodes", "0",
      "--gpus-per-node", "2"], "needs 4 devices"),
    (["--model", "tiny", "--from", "dp=2", "--to", "dp=1", "--drop-nodes", "9"],
     "cannot drop node(s) [9]"),
    (["--model", "tiny", "--from", "dp=1,tp=4", "--to", "dp=1,tp=4", "--gpus-per-node", "2"],
     "tp (4) must divide gpus per node (2)"),
])
def test_bad_input_is_one_line_exit_2(args, message):
    r = run(*args)
    assert r.exit_code == 2
    assert message in r.stderr
    assert "Traceback" not in r.output and len(r.stderr.strip().splitlines()) == 1


def test_malformed_json_model(tmp_path):
    f = tmp_path / "m.json"
    f.write_text("[1, 2")
    r = run("--model", str(f), "--from", "dp=1", "--to", "dp=2")
    assert r.exit_code == 2 and "is not valid JSON" in r.stderr
