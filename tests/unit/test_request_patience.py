"""The request patience is a policy key (``request_patience_s``, default 300 s): how long a
node request may pend before it is withdrawn and asked again smaller. Set with ``slurm-etc
policy set`` like every key (bounded, ``90s``/``5m``/``1h``), stored in the policy record
(real SQLite file), merged shorter-wins, and read where the decision is made: a policy with a
short patience withdraws earlier."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from slurm_etc.cli.main import cli
from slurm_etc.coordinator import deciding
from slurm_etc.policy import PolicyError, ResizePolicy, Scope, decide, effective
from slurm_etc.policy.admin import AdminVerdict, stricter
from slurm_etc.policy.decide import JobView, WithdrawRequest
from slurm_etc.policy.rules import EffectivePolicy, parse_assignments
from slurm_etc.store import get_policy, open_store
from tests.unit.grow_harness import HW, JOB, TOPO, fake_cost, growing_from_one_node, node, of, on

pytestmark = pytest.mark.unit


def test_patience_parses_like_a_duration_and_is_bounded() -> None:
    assert parse_assignments(["request_patience_s=2m"]) == {"request_patience_s": 120}
    assert parse_assignments(["request-patience-s=45"]) == {"request_patience_s": 45}
    with pytest.raises(PolicyError, match="request_patience_s must be seconds"):
        parse_assignments(["request_patience_s=soon"])
    with pytest.raises(PolicyError, match="request_patience_s must be an integer >= 1"):
        parse_assignments(["request_patience_s=0"])
    with pytest.raises(PolicyError, match="request_patience_s: .* exceeds the bound"):
        parse_assignments(["request_patience_s=999999h"])
    assert EffectivePolicy().patience_s == 300


def test_the_shorter_patience_wins_when_policies_merge() -> None:
    part = (Scope("partition", "gpu"), ResizePolicy(request_patience_s=600))
    acct = (Scope("account", "ml"), ResizePolicy(request_patience_s=120))
    assert effective([part, acct]).request_patience_s == 120
    assert effective([part]).request_patience_s == 600
    assert effective([]).patience_s == 300
    site = EffectivePolicy(request_patience_s=600)
    assert stricter(site, EffectivePolicy(request_patience_s=60)).patience_s == 60
    assert stricter(EffectivePolicy(request_patience_s=60), site).patience_s == 60
    # a user's policy that leaves it unset keeps the site's, even a longer one than 300 s
    assert stricter(site, EffectivePolicy()).patience_s == 600


def _pending(age_s: float) -> JobView:
    vranks, layout = on(node("n1"))
    return JobView(now=500.0, job=JOB, hardware=HW, topology=TOPO, held=node("n1"),
                    layout=layout, vranks=vranks, pinned=node("n1"), partition_nodes=4,
                    growing=3, request_age_s=age_s)


def test_a_policy_with_a_short_patience_withdraws_earlier() -> None:
    default = decide(_pending(100.0), EffectivePolicy(max_nodes=4), cost=fake_cost)
    assert not of(default, WithdrawRequest), default.lines()  # 100 s < 300 s
    short = decide(_pending(100.0), EffectivePolicy(max_nodes=4, request_patience_s=60),
                   cost=fake_cost)
    (withdraw,) = of(short, WithdrawRequest)
    assert "pending for 100 s (more than 60 s); asking for fewer" in str(withdraw)
    long = decide(_pending(400.0), EffectivePolicy(max_nodes=4, request_patience_s=3600),
                  cost=fake_cost)
    assert not of(long, WithdrawRequest), long.lines()


def test_the_coordinator_decides_again_once_the_policys_patience_passed(
        tmp_path: Path, recording_backend: Any) -> None:
    backend = recording_backend(TOPO)
    policy = EffectivePolicy(grow=True, max_nodes=4, request_patience_s=60)
    with growing_from_one_node(tmp_path, "patience", backend, policy, 30.0) as c:
        assert not deciding.request_overdue(c)
        c.request.sent_at = time.monotonic() - 100.0  # past 60 s, not 300 s
        assert deciding.request_overdue(c)
        deciding.decide_now(c)
        assert [w.key for w in backend.withdrawn] == ["grow-1"]
        assert backend.requested and backend.requested[0].nodes < 3


def test_policy_set_stores_the_patience(tmp_path: Path) -> None:
    db = tmp_path / "policies.db"
    admin = {"admin_check": lambda: AdminVerdict(True, "Slurm Administrator", "admin")}
    result = CliRunner().invoke(cli, ["policy", "--db", str(db), "set", "--partition", "gpu",
                                      "request_patience_s=10m"], obj=admin)
    assert result.exit_code == 0, result.output
    store = open_store(db)
    try:
        stored = get_policy(store, Scope("partition", "gpu"))
        assert stored is not None and stored.policy.request_patience_s == 600
    finally:
        store.close()
    bad = CliRunner().invoke(cli, ["policy", "--db", str(db), "set", "--partition", "gpu",
                                   "request_patience_s=0"], obj=admin)
    assert bad.exit_code == 2 and "request_patience_s must be an integer >= 1" in bad.output


def test_policy_show_gives_the_effective_patience(tmp_path: Path) -> None:
    import json

    db = tmp_path / "policies.db"
    admin = {"admin_check": lambda: AdminVerdict(True, "Slurm Administrator", "admin")}
    for scope, value in (("--partition", "gpu"), ("--account", "ml")):
        r = CliRunner().invoke(cli, ["policy", "--db", str(db), "set", scope, value,
                                     "max_nodes=8"], obj=admin)
        assert r.exit_code == 0, r.output
    show = ["policy", "--db", str(db), "show", "--partition", "gpu", "--account", "ml"]
    r = CliRunner().invoke(cli, [*show, "--json"], obj=admin)
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["effective"]["request_patience_s"] == 300  # unset: default
    r = CliRunner().invoke(cli, show, obj=admin, env={"COLUMNS": "200"})
    assert "300 (default)" in r.output, r.output
    r = CliRunner().invoke(cli, ["policy", "--db", str(db), "set", "--account", "ml",
                                 "request_patience_s=90s"], obj=admin)
    r = CliRunner().invoke(cli, [*show, "--json"], obj=admin)
    assert json.loads(r.output)["effective"]["request_patience_s"] == 90
