"""`slurm-etc verify` with ep / vpp / cp layouts: ep and vpp changes (with joiners, leavers,
the distributed optimizer or bf16 too) go to the executor path's ``verify_transition``, as dp,
tp and pp do; what megatron-core's local layers cannot build is refused in one line, exit 2,
before any worker process starts."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from slurm_etc.cli.main import cli
from slurm_etc.harness import verify
from tests.unit.verify_reports import report


@pytest.mark.parametrize("args, says", [
    (["--model", "tiny", "--from", "dp=2,cp=2", "--to", "dp=4"], "TEDotProductAttention"),
    (["--model", "tiny-moe", "--from", "dp=2,ep=2", "--to", "dp=1,tp=2"],
     "sequence parallel not supported by torch LayerNorm"),
])
def test_refused_in_one_line(args, says, monkeypatch):
    from slurm_etc.pool import local

    def no_start(*_a, **_k):
        raise AssertionError("a worker pool was started")

    monkeypatch.setattr(local.LocalWorkers, "start", no_start)
    result = CliRunner().invoke(cli, ["verify", *args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in result.output


@pytest.mark.parametrize("args, processes", [
    (["--model", "tiny-moe", "--from", "dp=4,ep=2", "--to", "dp=4,ep=4"], 4),
    (["--model", "tiny-moe", "--from", "dp=2,ep=2", "--to", "dp=4,ep=2"], 4),
    (["--model", "tiny", "--from", "dp=2,pp=2,vpp=2", "--to", "dp=1", "--param-dtype",
      "bf16"], 4),
    (["--model", "tiny", "--from", "dp=1,pp=2,vpp=2", "--to", "dp=2,pp=2,vpp=2",
      "--distributed-optimizer"], 4),
])
def test_ep_and_vpp_take_the_executor_path(args, processes, monkeypatch):
    seen = []

    def fake_verify(tr, **kwargs):
        seen.append(tr)
        return report()

    monkeypatch.setattr(verify, "verify_transition", fake_verify)
    result = CliRunner().invoke(cli, ["verify", *args, "--json"])
    assert result.exit_code == 0, result.output
    (tr,) = seen
    assert tr.processes == processes
