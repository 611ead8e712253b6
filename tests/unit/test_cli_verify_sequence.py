"""`slurm-etc verify --sequence`: bad input is one line, exit 2, and nothing starts."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from slurm_etc.cli.main import cli
from slurm_etc.plan import load_model
from slurm_etc.worker import sequence


@pytest.fixture
def never_runs(monkeypatch):
    def boom(*_a, **_k):
        raise AssertionError("verify_sequence must not start on bad input")
    monkeypatch.setattr(sequence, "verify_sequence", boom)


@pytest.mark.parametrize("args,message", [
    (["--sequence", "dp=2 => dp=1"], "expected layouts separated by '->'"),
    (["--sequence", "dp=2,tp=1 -> dp=1,tp=3"], "tp (3) must divide num_attention_heads (4)"),
    (["--sequence", "dp=1 -> dp=1,pp=3"], "pp (3) must divide num_layers (4)"),
    (["--sequence", "dp=2 -> dp=3", "--global-batch", "8"],
     "dp=3 cannot keep the global batch of 8"),
    (["--sequence", "dp=2 -> dp=1", "--from", "dp=1"], "either --sequence or --from/--to"),
    (["--sequence", "dp=2 -> dp=2"], "resizes dp=2,tp=1,pp=1 to itself"),
    (["--sequence", "dp=1,pp=2 -> dp=1,pp=2,vpp=2", "--global-batch", "3"],
     "multiple of pp"),
    (["--sequence", "dp=8 -> dp=16"], "more than --max-processes (8)"),
])
def test_bad_sequences_exit_2_with_one_line(never_runs, args, message):
    model = [] if "--model" in args else ["--model", "tiny"]
    result = CliRunner().invoke(cli, ["verify", *model, *args])
    assert result.exit_code == 2, result.output
    lines = [x for x in result.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("slurm-etc: error:"), result.output
    assert message in lines[0]
    assert "Traceback" not in result.output


def test_distributed_optimizer_across_tp_pp_is_held_against_the_no_resize_reference(
        monkeypatch):
    """megatron cannot reshard this optimizer on CPU: no checkpoint reference; the sequence
    runs against the no-resize reference instead of being refused."""
    seen = {}

    def fake(seq, **_k):
        seen["reference"] = sequence.reference_of(seq)
        return {"verified": True}

    monkeypatch.setattr(sequence, "verify_sequence", fake)
    monkeypatch.setattr("slurm_etc.cli.verify_sequence.render_sequence", lambda *_a: None)
    result = CliRunner().invoke(cli, ["verify", "--model", "tiny", "--sequence",
                                      "dp=2,tp=2 -> dp=1,pp=2", "--distributed-optimizer"])
    assert result.exit_code == 0, result.output
    assert seen == {"reference": sequence.NO_RESIZE_REFERENCE}
    plain = sequence.ResizeSequence(load_model("tiny"),
                                    tuple(sequence.parse_sequence("dp=2 -> dp=1", True)), 1, 8)
    assert sequence.reference_of(plain) == sequence.CHECKPOINT_REFERENCE
