"""bench/gpu_check.py on CPU, so the GPU check cannot rot where CI has no GPU.

Each case runs the script in a fresh process (it starts a torch.distributed group and
installs megatron's CPU patches, which must not leak into this one).
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_cli_on_cpu_reports_every_check(tmp_path):
    proc = _run([str(SCRIPT), "--device", "cpu", "--models", "tiny,tiny-llama", "--steps", "2",
                 "--staging-mib", "1", "--idle-s", "1", "--json", "--out", str(tmp_path)],
                timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == report
    assert report["device"] == "cpu" and "NCCL between ranks" in report["unmeasured"]
    # the product's own trainer in a worker process of its own, on the device it chose
    trainer = report["trainer"]
    assert trainer["device"] == "cpu" and trainer["backend"] == "gloo"
    assert trainer["exits"] == ["done"] and len(trainer["losses"]) == 2 and trainer["finite"]
    idle = report["store_idle"]
    assert idle["connections_after_idle"] <= idle["connections_after_collective"] <= 2
    assert report["preflight"]["free_bytes"] is None  # host memory is not checked
    assert [r["model"] for r in report["results"]] == ["tiny", "tiny-llama"]
    for r in report["results"]:
        assert len(r["losses"]) == 2 and all(math.isfinite(x) for x in r["losses"])
        assert set(r["view_bytes"]) == {"param", "exp_avg", "exp_avg_sq"}
        assert r["state_bytes"] == sum(r["view_bytes"].values()) > 0
        p = r["packing"]
        # 1 MiB staging: a 256 KiB chunk, so the tp=1 -> tp=2 message travels in several
        assert p["chunk_bytes"] == 256 << 10 and p["pack_chunks"] > 1
        assert p["packed_bytes"] > 0 and p["pack_gbps"] > 0 and p["copy_gbps"] > 0
        z = r["resize"]
        assert z["bit_equal"] and z["next_loss_equal"] and z["tp2_shards_checked"] > 0
        assert z["tensors_compared"] > 0 and z["tp1_to_tp2_bytes"] > 0
        assert math.isfinite(z["step_after_resize_loss"])


_PLANTED = textwrap.dedent("""
    import dataclasses, importlib.util, json, sys, torch
    spec = importlib.util.spec_from_file_location("gpu_check", sys.argv[1])
    gc = importlib.util.module_from_spec(spec); spec.loader.exec_module(gc)
    from slurm_etc.plan import PRESETS
    dev = torch.device("cpu"); gc.start(dev)
    kw = dict(steps=1, seed=3, seq=16, global_batch=2, staging_bytes=1 << 20)
    out = {}
    bf16 = dataclasses.replace(PRESETS["tiny"], name="tiny-bf16", param_dtype="bf16")
    r = gc.check_model(bf16, dev, **kw)
    out["bf16"] = [sorted(r["view_bytes"]), r["resize"]["bit_equal"]]

    def plant(where):
        def f(stage, shards):
            if stage != where:
                return
            if stage == "views":  # the adapter mixing up the two Adam moments
                i = next(i for i, s in enumerate(shards) if ".exp_avg_sq." in s.state_key)
                twin = shards[i].state_key.replace(".exp_avg_sq.", ".exp_avg.")
                j = next(j for j, s in enumerate(shards) if s.state_key == twin)
                shards[i].tensor, shards[j].tensor = shards[j].tensor, shards[i].tensor
            else:  # one bit of one moved shard
                shards[len(shards) // 2].tensor.view(-1)[:1].view(torch.uint8)[0] ^= 1
        return f

    for where in ("views", "tp2", "tp1"):
        try:
            gc.check_model(PRESETS["tiny"], dev, plant=plant(where), **kw)
            out[where] = "not caught"
        except RuntimeError as exc:
            out[where] = str(exc)
            gc.build.teardown()
    print(json.dumps(out))
""")


def test_checks_catch_planted_bugs_and_run_mixed_precision():
    proc = _run(["-c", _PLANTED, str(SCRIPT)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["bf16"] == [["exp_avg", "exp_avg_sq", "fp32_param", "param"], True]
    assert "adapter views wrong" in out["views"] and "exp_avg" in out["views"]
    assert "tp=2 shards wrong after the resize" in out["tp2"]
    assert "the resized state differs from the original" in out["tp1"]


def test_unknown_model_is_one_line_exit_2():
    proc = _run([str(SCRIPT), "--device", "cpu", "--models", "no-such-model"])
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "unknown model 'no-such-model'" in proc.stderr.strip().splitlines()[-1]
