"""The README's example runs with one command and shows a resize happen."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"


def test_example_trains_through_a_resize():
    done = subprocess.run([sys.executable, str(EXAMPLE), "--sequence",
                           "dp=2,tp=1,pp=1 -> dp=1,tp=2,pp=1", "--steps", "2", "--json"],
                          capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert [h["step"] for h in out["history"]] == [1, 2, 3, 4]
    assert [h["layout"] for h in out["history"]] == ["dp=2,tp=1,pp=1"] * 2 + \
        ["dp=1,tp=2,pp=1"] * 2
    (resize,) = out["resizes"]
    assert (resize["old"], resize["new"], resize["outcome"]) == \
        ("dp=2,tp=1,pp=1", "dp=1,tp=2,pp=1", "committed")
    assert resize["pause_seconds"] > 0
    # the log lines a user sees: old layout, new layout, bytes moved, pause seconds
    assert "resized dp=2,tp=1,pp=1 -> dp=1,tp=2,pp=1: moved" in done.stderr
    assert "pause" in done.stderr


def test_example_refuses_a_bad_sequence_in_one_line():
    done = subprocess.run([sys.executable, str(EXAMPLE), "--sequence", "dp=2 -> dp=3"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("error: dp=3 cannot keep")
