"""`slurm-etc verify` with ep / vpp / cp layouts: what the live reshard or megatron-core's local
layers cannot do is refused in one line, exit 2, before any worker process starts."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from slurm_etc.cli.main import cli


@pytest.mark.parametrize("args, says", [
    (["--model", "tiny", "--from", "dp=2,cp=2", "--to", "dp=4"], "TEDotProductAttention"),
    (["--model", "tiny", "--from", "dp=2,pp=2,vpp=2", "--to", "dp=4",
      "--distributed-optimizer"], "distributed optimizer"),
    (["--model", "tiny", "--from", "dp=2,pp=2,vpp=2", "--to", "dp=2"], "keeps the processes"),
    (["--model", "tiny", "--from", "dp=2,pp=2,vpp=2", "--to", "dp=4", "--param-dtype", "bf16"],
     "fp32 states only"),
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
