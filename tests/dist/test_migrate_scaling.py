"""bench/migrate_scaling.py on two tiny sizes, once each (``--repeat 1``): the JSON, the PNG,
the table, and every size's ``bench migrate`` summary complete and sane.

No timing is asserted (the machine is shared): only that every figure exists, is positive
where it must be, fits the spans measured around it, and that both paths end in the same
state. The state sizes are checked against a parameter count written out here from the
GPT architecture (no slurm-etc catalog). Each checker is shown to fail on a planted fault.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from slurm_etc.harness.phases import Transition
from slurm_etc.plan import ParallelConfig, load_model

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "bench" / "migrate_scaling.py"
# twice tiny's width: a second size, 3.8x tiny's state
TINY2 = {"num_layers": 4, "hidden": 128, "ffn_hidden": 512, "num_heads": 4, "vocab_size": 256,
         "seq_length": 64, "param_dtype": "fp32", "vocab_divisor": 64}
FROM, TO = ParallelConfig(1, 2, 2), ParallelConfig(2, 1, 2)


def gpt_state_bytes(layers: int, hidden: int, ffn: int, vocab: int, seq: int) -> int:
    """fp32 Adam state of a megatron GPT with biases, LayerNorm, learned positions and a
    tied output layer: 4 bytes of parameter and 8 of the two moments per parameter."""
    per_layer = (3 * hidden * hidden + 3 * hidden      # qkv
                 + hidden * hidden + hidden            # attention projection
                 + hidden * ffn + ffn + ffn * hidden + hidden  # mlp
                 + 4 * hidden)                         # two LayerNorms (weight, bias)
    params = vocab * hidden + seq * hidden + layers * per_layer + 2 * hidden
    return 12 * params


def driver_module():
    spec = importlib.util.spec_from_file_location("migrate_scaling", DRIVER)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scaling")
    tiny2 = tmp / "tiny2.json"
    tiny2.write_text(json.dumps(TINY2))
    out_json, out_png = tmp / "scaling.json", tmp / "scaling.png"
    # the larger one first: the driver sorts by state size
    r = subprocess.run([sys.executable, str(DRIVER), "--models", f"{tiny2},tiny",
                        "--repeat", "1", "--p2p-mb", "8", "--out-json", str(out_json),
                        "--out-png", str(out_png), "--json"],
                       capture_output=True, text=True, cwd=ROOT, timeout=560)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    return {"result": json.loads(r.stdout), "file": json.loads(out_json.read_text()),
            "png": out_png.read_bytes(), "stderr": r.stderr, "tiny2": str(tiny2)}


def check_summary(s: dict, model_spec: str) -> None:
    """One size's ``bench migrate`` summary: complete, and its parts fit its spans."""
    plan = Transition(load_model(model_spec), FROM, TO).plan()
    assert s["moved_bytes"] == plan.moved_bytes > 0
    for key in ("etc_seconds", "checkpoint_seconds", "ratio", "data_seconds",
                "achieved_gibps", "raw_p2p_gibps", "raw_p2p_fresh_gibps",
                "raw_pattern_seconds", "data_over_raw_pattern", "peak_over_bound_max"):
        assert s[key] is not None and s[key] > 0, key
    parts = s["checkpoint_parts"]
    # both downtimes are wall-clock spans, first rank paused to last rank ready; the ratio's
    # is the one with the cold start of a node with a core per process
    assert s["ratio_cold_start"] == "per_process_core"
    assert s["checkpoint_seconds"] == pytest.approx(
        parts["save"] + parts["stop"] + parts["cold_start"] + parts["build_load"])
    assert parts["cold_start"] == pytest.approx(max(parts["cold_start_each"]))
    assert len(parts["cold_start_each"]) == len(parts["cold_start_each_all_at_once"]) == 4
    # started one at a time, each start is inside the pool's whole start-up, one after the
    # other: a start measured from the pool's beginning instead of its own spawn fails this
    assert sum(parts["cold_start_each"]) <= parts["cold_start_one_at_a_time_total"]
    assert max(parts["cold_start_each_all_at_once"]) <= parts["cold_start_all_at_once"]
    # the all-at-once downtime is measured in one piece: its parts, measured separately on
    # every process's clock, fit inside it, leaving only the parent's hand-offs (a part
    # counted twice, or a sum of per-rank maxima over overlapping phases, fails this)
    assert 0 <= parts["handoffs_all_at_once"] < 1.0
    assert s["checkpoint_seconds_all_at_once"] == pytest.approx(
        parts["save"] + parts["stop"] + parts["cold_start_all_at_once"]
        + parts["build_load_all_at_once"] + parts["handoffs_all_at_once"])
    # the slowest rank's group, build and load each lie inside the build + load span, and
    # megatron's save and the extra fsync inside the save span
    assert max(parts["group"], parts["build"], parts["load"]) <= parts["build_load"] + 1e-6
    assert max(parts["megatron_save"], parts["extra_fsync"]) <= parts["save"] + 1e-6
    assert parts["checkpoint_bytes"] >= s["state_bytes"]
    assert s["ratio"] == pytest.approx(s["checkpoint_seconds"] / s["etc_seconds"])
    assert s["ratio_all_at_once"] == pytest.approx(
        s["checkpoint_seconds_all_at_once"] / s["etc_seconds"])
    load = s["load_average"]
    assert load["cpus"] >= 1 and len(load["before"]) == len(load["after"]) == 3
    # the pause's phases are read from the resize, whatever it names; the data phase is one
    assert "migrate" in s["etc_parts"] and "pause" not in s["etc_parts"]
    assert all(v is not None and v >= 0 for v in s["etc_parts"].values())
    # connected and allocated before the pause, not part of the downtime
    assert s["prepare_parts"] and all(v > 0 for v in s["prepare_parts"].values())
    assert s["same_state"] is True
    (run,) = s["runs"]
    ranks = run["etc"]["per_rank"]
    assert [p["device"] for p in ranks] == [0, 1, 2, 3]
    assert sum(p["sent_bytes"] for p in ranks) == sum(p["received_bytes"] for p in ranks) \
        == plan.moved_bytes
    for p in ranks:
        assert p["memory_peak_delta"] is not None and p["memory_bound"] > 0
        # a process's phases follow one another inside its own pause .. ready span, and the
        # downtime spans every new rank's (a departing one's clean-up is no downtime)
        assert 0 < sum(p["phases"].values()) <= p["span"], p
        assert p["new_rank"] is None or p["span"] <= s["etc_seconds"] + 1e-6, p
        assert set(p["phases"]) <= set(s["etc_parts"])
    assert all(p["phases"]["migrate"] > 0 for p in ranks)
    assert run["raw_p2p"]["ok"]


def check_row(row: dict, s: dict, state_bytes: int) -> None:
    """A size's row in the scaling table: the summary's figures, the right state size."""
    assert row["state_bytes"] == s["state_bytes"] == state_bytes
    assert row["state_gib"] == pytest.approx(state_bytes / 2**30)
    assert row["in_place_seconds"] == s["etc_seconds"]
    assert row["in_place_parts"] == s["etc_parts"]
    assert row["checkpoint_seconds"] == pytest.approx(sum(row["checkpoint_parts"].values()))
    assert set(row["checkpoint_parts"]) == {"save", "stop", "cold_start", "group_build_load"}
    assert row["ratio"] == pytest.approx(row["checkpoint_seconds"] / row["in_place_seconds"])
    assert row["data_over_raw_pattern"] == s["data_over_raw_pattern"] > 0
    assert row["same_state"] is True
    memory = row["host_memory"]
    assert 0 < memory["available_min"] <= memory["available_before"] <= memory["total"]
    assert len(row["load_average"]["before"]) == len(row["load_average"]["after"]) == 3


RED, BLUE = (214, 39, 40), (31, 119, 180)  # matplotlib's tab:red and tab:blue


def check_png(data: bytes) -> None:
    """A PNG of a plot with both paths drawn (the checkpoint path red, in place blue)."""
    import io

    import matplotlib.image

    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 800 and height >= 300, (width, height)
    pixels = (matplotlib.image.imread(io.BytesIO(data), format="png")[..., :3] * 255).round()
    assert pixels.shape[:2] == (height, width)
    for color in (RED, BLUE):
        hits = (abs(pixels - color).max(axis=-1) <= 2).sum()
        assert hits >= 50, (color, hits)


def test_result_complete(run):
    res = run["result"]
    assert res == run["file"]  # stdout and the file agree
    assert res["complete"] is True and res["repeat"] == 1
    assert res["transition"] == {"from": str(FROM), "to": str(TO),
                                 "distributed_optimizer": False}
    commit = res["git"]["commit"]
    assert len(commit) == 40
    exists = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=ROOT)
    assert exists.returncode == 0
    # smallest first, whatever order they were given in
    assert [r["model_spec"] for r in res["sizes"]] == ["tiny", run["tiny2"]]
    # progress went to stderr, size by size
    assert "[size 1/2" in run["stderr"] and "[size 2/2" in run["stderr"]


def test_each_size_consistent(run):
    res = run["result"]
    expected = [gpt_state_bytes(4, 64, 256, 256, 64), gpt_state_bytes(4, 128, 512, 256, 64)]
    for row, s, state_bytes in zip(res["sizes"], res["summaries"], expected, strict=True):
        check_summary(s, row["model_spec"])
        check_row(row, s, state_bytes)


def test_png_shows_both_paths(run):
    check_png(run["png"])


def test_tables_render(run):
    res = run["result"]
    console = Console(record=True, width=250)
    driver_module().render(res, console)
    text = console.export_text()
    for row in res["sizes"]:
        assert f"{row['ratio']:.1f}x" in text
        assert f"data phase {row['in_place_parts']['migrate']:.2f}" in text
    from slurm_etc.cli.cmd_bench import render

    render(res["summaries"][0], console)  # bench migrate's own table, on a real summary
    assert "in-place downtime" in console.export_text()


def test_checkers_catch_planted_faults(run, tmp_path):
    res = run["result"]
    row, s = res["sizes"][0], res["summaries"][0]
    expected = gpt_state_bytes(4, 64, 256, 256, 64)
    plants = {
        "ratio over the all-at-once downtime": ("row", lambda r, _: r.update(
            ratio=r["checkpoint_seconds_all_at_once"] / r["in_place_seconds"])),
        "a checkpoint part dropped": ("row", lambda r, _: r["checkpoint_parts"].pop("stop")),
        "states differ": ("summary", lambda _, x: x.update(same_state=False)),
        "data phase missing": ("summary", lambda _, x: x["etc_parts"].pop("migrate")),
        "a part counted twice": ("summary", lambda _, x: x.update(
            checkpoint_seconds=x["checkpoint_seconds"] + x["checkpoint_parts"]["save"])),
        "bytes of one rank lost": ("summary", lambda _, x: x["runs"][0]["etc"]["per_rank"][0]
                                   .update(received_bytes=0)),
    }
    for name, (where, plant) in plants.items():
        r, x = copy.deepcopy(row), copy.deepcopy(s)
        plant(r, x)
        with pytest.raises(AssertionError):
            check_summary(x, "tiny") if where == "summary" else check_row(r, x, expected)
            pytest.fail(f"planted fault not caught: {name}")  # pragma: no cover
    with pytest.raises(AssertionError):  # the size of another model
        check_row(row, s, gpt_state_bytes(4, 64, 256, 256, 32))
    # a plot with only one path drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot([1, 2], [3, 4], color="tab:blue")
    fig.savefig(tmp_path / "one.png")
    plt.close(fig)
    with pytest.raises(AssertionError):
        check_png((tmp_path / "one.png").read_bytes())
    with pytest.raises(AssertionError):
        check_png(b"\x89PNG\r\n\x1a\n" + bytes(40))


@pytest.mark.parametrize("args, says", [
    (["--models", "nope"], "unknown model 'nope'"),
    (["--models", "tiny,tiny"], "same state size"),
    (["--models", "tiny", "--from", "dp=1,tp=3,pp=1"], "tp (3) must divide"),
    (["--models", ","], "--models needs"),
    (["--repeat", "0"], "'--repeat'"),
    (["--models", "tiny", "--out-json", "/nonexistent/x.json"], "does not exist"),
    (["--models", "tiny", "--out-png", "/tmp"], "is a directory"),
    (["--models", "tiny,gpt-1.3b"], "GiB of memory needed"),
], ids=["unknown-model", "same-size", "bad-layout", "empty-models", "repeat-0",
        "out-dir-missing", "png-is-dir", "too-big"])
def test_bad_input_one_line_nothing_written(tmp_path, args, says):
    out = ["--out-json", str(tmp_path / "s.json"), "--out-png", str(tmp_path / "s.png")]
    r = subprocess.run([sys.executable, str(DRIVER), *out, *args], capture_output=True,
                       text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("migrate_scaling.py: error: "), r.stderr
    assert says in lines[0], lines[0]
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert list(tmp_path.iterdir()) == []
