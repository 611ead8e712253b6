"""The worker's environment read back in one place (slurm_etc.protocol.env.WorkerEnv): what
the coordinator, its channel and the backend set, and one line for what is missing or
malformed."""
from __future__ import annotations

import pytest

from slurm_etc.plan.errors import ConfigError
from slurm_etc.protocol import env as names
from slurm_etc.protocol.env import WorkerEnv
from slurm_etc.protocol.messages import format_layout, parse_layout

pytestmark = pytest.mark.unit


def test_what_the_launch_sets_is_read_back() -> None:
    layout = parse_layout("dp=2,tp=1,pp=1@0,1")
    got = WorkerEnv.of({names.JOB: "j", names.VRANK: "3", names.GENERATION: "2",
                        names.LAYOUT: format_layout(layout), names.GPUS_PER_NODE: "4",
                        names.TIMEOUT: "60", names.REATTACH_WAIT: "30.5"})
    assert got == WorkerEnv("j", 3, 2, "dp=2,tp=1,pp=1@0-1", 4, 60.0, 30.5)
    assert parse_layout(got.layout or "") == layout


def test_defaults_where_the_launch_sets_nothing() -> None:
    got = WorkerEnv.of({names.JOB: "j", names.VRANK: "0", names.REATTACH_WAIT: ""})
    assert got == WorkerEnv("j", 0)
    assert got.timeout_s == names.DEFAULT_TIMEOUT_S
    assert got.reattach_wait_s == names.DEFAULT_REATTACH_WAIT_S


@pytest.mark.parametrize("environ, says", [
    ({}, "SLURM_ETC_JOB, SLURM_ETC_VRANK not set"),
    ({names.JOB: "j"}, "SLURM_ETC_VRANK not set"),
    ({names.JOB: "j", names.VRANK: "x"}, "SLURM_ETC_VRANK='x': expected a number"),
    ({names.JOB: "j", names.VRANK: "1", names.TIMEOUT: "soon"},
     "SLURM_ETC_TIMEOUT_S='soon'"),
    ({names.JOB: "j", names.VRANK: "1", names.GENERATION: "-1"}, ">= 0"),
])
def test_a_missing_or_malformed_value_is_one_line(environ: dict[str, str], says: str) -> None:
    with pytest.raises(ConfigError, match=None) as err:
        WorkerEnv.of(environ)
    assert says in str(err.value) and "\n" not in str(err.value)
