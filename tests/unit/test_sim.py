"""Simulator: trace format, event semantics, both allocators, the simulate command."""
import json

import pytest
from click.testing import CliRunner

from slurm_etc.cli.main import cli
from slurm_etc.sim import TraceError, load_trace, parse_trace, simulate, synthetic_trace
from slurm_etc.sim.engine import Simulation

pytestmark = pytest.mark.unit


def small_trace(**extra):
    """8 nodes x 4 GPUs, one elastic gpt-1.3b on a 2-node anchor."""
    data = {
        "cluster": {"nodes": 8, "gpus_per_node": 4, "nodes_per_switch": 4},
        "duration": 4000,
        "policies": [{"scope": "partition:gpu", "min_nodes": 1, "max_nodes": 6}],
        "jobs": [{"name": "train", "model": "gpt-1.3b", "global_batch": 64, "nodes": 2}],
        "events": [
            {"t": 100, "kind": "grow", "job": "train", "gpus": 3},
            {"t": 200, "kind": "grow", "job": "train", "nodes": 2},
            {"t": 300, "kind": "submit", "job": "r1", "gpus": 2, "duration": 3000},
            {"t": 1000, "kind": "preempt", "job": "train", "gpus": 4, "duration": 500},
            {"t": 2000, "kind": "fail", "node": 7},
            {"t": 3000, "kind": "recover", "node": 7},
        ],
    }
    data.update(extra)
    return data


@pytest.mark.parametrize("change, message", [
    ({"events": [{"t": 1, "kind": "grnat", "job": "train", "gpus": 1}]}, "unknown kind"),
    ({"events": [{"t": 1, "kind": "grow", "job": "train"}]}, "exactly one of gpus or nodes"),
    ({"events": [{"t": 1, "kind": "grow", "job": "x", "gpus": 1}]}, "must name an elastic"),
    ({"events": [{"t": 1, "kind": "grow", "job": "train", "gpus": 9}]}, "gpus must be 1..4"),
    ({"events": [{"t": 1, "kind": "fail", "node": 8}]}, "node index 0..7"),
    ({"events": [{"t": 1, "kind": "submit", "job": "r", "gpus": 1}]}, "duration"),
    ({"events": [{"t": 1, "kind": "grow", "job": "train", "gpus": 1, "size": 2}]},
     "unknown field.*size"),
    ({"jobs": [{"name": "a", "model": "nope", "global_batch": 8, "nodes": 1}]},
     "unknown model 'nope'"),
    ({"policies": [{"scope": "partition:gpu", "min_nodes": 0}]}, "min_nodes must be"),
])
def test_invalid_traces_say_where_and_what(change, message):
    with pytest.raises(TraceError, match=message):
        parse_trace(small_trace(**change), "t.json")


def test_trace_files_round_trip(tmp_path):
    trace = synthetic_trace(nodes=16, jobs=2, hours=1, seed=3)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace.to_json()))
    assert load_trace(path) == trace
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(TraceError, match="not valid JSON"):
        load_trace(tmp_path / "bad.json")


def test_synthetic_traces_are_reproducible():
    assert synthetic_trace(nodes=32, hours=2, seed=5) == synthetic_trace(nodes=32, hours=2,
                                                                         seed=5)
    assert synthetic_trace(nodes=32, hours=2, seed=5) != synthetic_trace(nodes=32, hours=2,
                                                                         seed=6)


def test_preemptions_take_the_newest_members_never_the_anchor():
    sim = Simulation(parse_trace(small_trace()), "naive")
    sim.run()
    job = sim.jobs["train"]
    anchor = [d for d, grant in job.held.items() if grant == 0]
    assert len(anchor) == 8
    # 8 anchor + 3 + 8 granted - 4 preempted - what node 7 took
    assert sim.counters["preempted_gpus"] == 4


def test_compact_holds_nothing_idle_and_naive_holds_the_leftovers():
    trace = parse_trace(small_trace())
    compact, naive = simulate(trace, "compact"), simulate(trace, "naive")
    assert compact.summary["idle_held_gpus"] == 0
    assert naive.summary["idle_held_gpus"] > 0
    # the compact allocator keeps every tensor-parallel group inside one node
    assert compact.summary["split_tp_groups"] == 0
    for r in (compact, naive):
        assert all(0 <= o <= 1 for o in r.occupancy)
        assert len(r.times) == len(r.occupancy) == len(r.idle_held) == len(r.partial_nodes)
        # the summary's averages are the time integrals of the series (each value holds until
        # the next sample, the last one until the end of the trace)
        ends = [*r.times[1:], trace.duration]
        for series, name in ((r.idle_held, "idle_held_gpus"), (r.partial_nodes, "partial_nodes")):
            integral = sum(v * (b - a) for v, a, b in zip(series, r.times, ends))
            assert r.summary[name] == pytest.approx(integral / trace.duration), name


def test_a_failed_node_kills_rigid_jobs_on_it():
    data = small_trace(events=[
        {"t": 10, "kind": "submit", "job": "r1", "nodes": 6, "duration": 5000},
        {"t": 20, "kind": "fail", "node": 7},
    ])
    sim = Simulation(parse_trace(data), "compact")
    summary = sim.run().summary
    assert summary["rigid_killed"] == 1 and not sim.rigid


def test_synthetic_replay_compact_beats_naive_on_fragmentation():
    trace = synthetic_trace(nodes=32, jobs=3, hours=3, seed=1)
    compact, naive = simulate(trace, "compact"), simulate(trace, "naive")
    assert compact.summary["idle_held_gpus"] <= naive.summary["idle_held_gpus"]
    assert compact.summary["split_tp_groups"] == 0


def test_simulate_command_with_a_trace_file(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(small_trace()))
    png = tmp_path / "occ.png"
    r = CliRunner().invoke(cli, ["simulate", "--trace", str(path), "--json", "--plot",
                                 str(png)])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert set(out) >= {"compact", "naive", "occupancy_gain_pp", "partial_nodes_ratio",
                        "moved_bytes_ratio"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = CliRunner().invoke(cli, ["simulate", "--trace", str(path)])
    assert "GPU occupancy" in table.stdout and "bytes migrated" in table.stdout


def test_simulate_command_synthetic_saves_its_trace(tmp_path):
    saved = tmp_path / "syn.json"
    r = CliRunner().invoke(cli, ["simulate", "--synthetic", "--nodes", "16", "--jobs", "1",
                                 "--hours", "1", "--save-trace", str(saved), "--json"])
    assert r.exit_code == 0, r.output
    assert load_trace(saved).cluster.nodes == 16


@pytest.mark.parametrize("args, message", [
    ([], "give exactly one of --trace FILE, --synthetic or --sacct FILE"),
    (["--synthetic", "--trace", "x.json"], "give exactly one"),
    (["--trace", "/nonexistent.json"], "trace file /nonexistent.json does not exist"),
])
def test_simulate_command_rejects_bad_input_in_one_line(args, message):
    r = CliRunner().invoke(cli, ["simulate", *args])
    assert r.exit_code == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1
