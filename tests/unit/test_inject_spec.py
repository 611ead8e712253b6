"""The kill spec (``SLURM_ETC_INJECT`` / ``slurm-etc demo --inject``): parsing, bad input in
one line, which worker of a plan is the victim, and that only the victim's injector is armed.
The kills themselves run in tests/dist/test_inject.py."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from slurm_etc.cli.main import cli
from slurm_etc.migrate.faults import KILL_PHASES, FaultInjector, KillSpec
from slurm_etc.plan import Layout, ParallelConfig, Topology, plan_migration
from slurm_etc.plan.model import PRESETS
from slurm_etc.testing.hooks import kill_spec_from_env


def test_parse_forms():
    assert KillSpec.parse("mid-transfer") == KillSpec("mid-transfer", None, 1)
    assert KillSpec.parse("after-commit@3") == KillSpec("after-commit", 3, 1)
    assert KillSpec.parse("before-send@0,4") == KillSpec("before-send", 0, 4)
    assert kill_spec_from_env({}) is None
    assert kill_spec_from_env({"SLURM_ETC_INJECT": " "}) is None
    assert kill_spec_from_env({"SLURM_ETC_INJECT": "after-receive"}) == KillSpec("after-receive")


@pytest.mark.parametrize("text, says", [
    ("bogus", "unknown phase 'bogus'"), ("mid_transfer", "unknown phase"),
    ("mid-transfer@x", "must be integers"), ("mid-transfer@1,y", "must be integers"),
    ("mid-transfer@-1", "vrank must be >= 0"), ("after-commit@1,0", "generation >= 1"),
])
def test_parse_rejects_in_one_line(text, says):
    with pytest.raises(ValueError) as err:
        KillSpec.parse(text)
    msg = str(err.value)
    assert says in msg and "\n" not in msg and "form <phase>" in msg


def _grow_plan():
    """dp=2 on vranks 0,1 -> dp=2,tp=2 on 0..3: old ranks send, joiners 2,3 receive."""
    model = PRESETS["tiny"]
    old = Layout(ParallelConfig(dp=2, tp=1, pp=1), (0, 1))
    return plan_migration(model, old, ParallelConfig(dp=2, tp=2, pp=1), [0, 1, 2, 3],
                          Topology(gpus_per_node=2), keep_tp_in_node=True)


def test_default_victim_does_the_phase():
    plan = _grow_plan()
    senders = {int(x) for x in plan.messages.src}
    receivers = {int(x) for x in plan.messages.dst}
    assert senders and receivers and not senders & receivers
    assert KillSpec("before-send").victim(plan) == max(senders)
    assert KillSpec("after-receive").victim(plan) == max(receivers)
    assert KillSpec("mid-transfer").victim(plan) == max(senders | receivers)
    assert KillSpec("before-commit").victim(plan) == max(plan.participants)
    assert KillSpec.parse("after-commit@1").victim(plan) == 1
    assert KillSpec.parse("after-commit@7").victim(plan) is None  # not in this resize


def test_only_the_victim_is_armed_and_only_in_its_generation():
    plan = _grow_plan()
    spec = KillSpec("after-receive")
    victim = spec.victim(plan)
    armed = spec.injector(plan, victim, 1)
    assert armed.kills == ((plan.participants.index(victim), "after-receive"),)
    for d in plan.participants:
        if d != victim:
            assert spec.injector(plan, d, 1) == FaultInjector()
    assert spec.injector(plan, victim, 2) == FaultInjector()


def test_injector_rejects_unknown_phase_and_does_not_fire_elsewhere():
    with pytest.raises(ValueError, match="unknown kill phase"):
        FaultInjector().kill(0, "sometime")
    inj = FaultInjector().kill(2, "mid-transfer")
    for phase in KILL_PHASES:  # another rank, or another phase: nothing happens
        inj.die_if(1, phase)
    inj.die_if(2, "before-send")


def test_demo_rejects_bad_inject_before_starting(tmp_path):
    out = tmp_path / "demo"
    res = CliRunner().invoke(cli, ["demo", "--inject", "sometimes", "--out", str(out)])
    assert res.exit_code == 2
    assert "unknown phase 'sometimes'" in res.output
    assert not out.exists()  # nothing started, nothing written
