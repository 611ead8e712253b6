"""`slurm-etc plan --choose` through click's CliRunner: the chooser's ranking with ep, vpp and
cp, the same choice as the library's, and one-line user errors."""
import json

import pytest
from click.testing import CliRunner

from slurm_etc.alloc.chooser import Hardware, TrainingJob, choose_config
from slurm_etc.cli.main import cli
from slurm_etc.plan import PRESETS, ParallelConfig

pytestmark = pytest.mark.unit


def run(*args):
    return CliRunner().invoke(cli, ["plan", "--choose", *args])


def test_choose_ranks_with_ep_vpp_cp_and_names_the_librarys_choice():
    r = run("--model", "mixtral-8x7b", "--nodes", "8", "--global-batch", "1024",
            "--distributed-optimizer", "--memory-gib", "40", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    job = TrainingJob(PRESETS["mixtral-8x7b"], 1024, 1, True, {"ep", "vpp", "cp"})
    want = choose_config(job, Hardware(memory_gib=40), [8] * 8)
    assert out["chosen"] == str(want.config) == out["ranking"][0]["layout"]
    assert out["candidates"] == want.considered
    assert out["considered_degrees"] == ["dp", "tp", "pp", "ep", "vpp", "cp"]
    layouts = [ParallelConfig.parse(row["layout"].replace(",dist-opt", ""), True)
               for row in out["ranking"]]
    assert all(c.world <= 64 for c in layouts)
    assert any(c.ep > 1 or c.cp > 1 or c.vpp > 1 for c in layouts)
    tokens = [row["tokens_per_s"] for row in out["ranking"]]
    assert tokens == sorted(tokens, reverse=True) and len(tokens) == 10
    assert all(row["memory_bytes"] <= 34 * 2 ** 30 for row in out["ranking"])


def test_consider_none_is_what_the_elastic_worker_builds():
    r = run("--model", "mixtral-8x7b", "--nodes", "16", "--global-batch", "1024",
            "--distributed-optimizer", "--consider", "none", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    job = TrainingJob(PRESETS["mixtral-8x7b"], 1024, 1, True)
    assert out["chosen"] == str(choose_config(job, Hardware(), [8] * 16).config)
    assert out["considered_degrees"] == ["dp", "tp", "pp"]
    for row in out["ranking"]:
        c = ParallelConfig.parse(row["layout"].replace(",dist-opt", ""))
        assert (c.ep, c.cp, c.vpp) == (1, 1, 1)


def test_human_table():
    r = run("--model", "llama-70b", "--nodes", "32", "--global-batch", "64",
            "--consider", "vpp")
    assert r.exit_code == 0, r.output
    assert "chosen: dp=8,tp=4,pp=8,vpp=5" in r.stdout and "bubble" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--model", "tiny", "--nodes", "1"], "--choose needs --global-batch"),
    (["--model", "tiny", "--global-batch", "8"], "--choose needs --nodes"),
    (["--model", "tiny", "--nodes", "1", "--global-batch", "8", "--consider", "ep,sp"],
     "--consider: 'sp' given; expected a comma list of ep, vpp, cp, or none"),
    (["--model", "tiny", "--nodes", "1", "--global-batch", "8", "--from", "dp=1",
      "--add-nodes", "0"], "--choose ranks layouts for --nodes; it takes no --from, "
     "--add-nodes"),
    (["--model", "tiny", "--nodes", "1", "--global-batch", "6", "--micro-batch", "4"],
     "micro_batch (4) must divide global_batch (6)"),
    (["--model", "llama-70b", "--nodes", "1", "--global-batch", "8"],
     "no parallel configuration of llama-70b fits 8 devices"),
    (["--model", "tiny", "--nodes", "1", "--global-batch", "8", "--memory-gib", "2"],
     "--memory-gib (2) must exceed the 6 GiB reserved per device"),
])
def test_bad_input_is_one_line_exit_2(args, message):
    r = run(*args)
    assert r.exit_code == 2, r.output
    assert message in r.stderr
    assert "Traceback" not in r.output and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args, message", [
    (["--from", "dp=2"], "Missing option '--to' (or give --choose)"),
    (["--from", "dp=2", "--to", "dp=1", "--micro-batch", "2", "--nodes", "2"],
     "--nodes, --micro-batch only go with --choose"),
])
def test_plan_without_choose_still_needs_from_and_to(args, message):
    r = CliRunner().invoke(cli, ["plan", "--model", "tiny", *args])
    assert r.exit_code == 2
    assert message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
