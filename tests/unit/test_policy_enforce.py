"""`policy apply|check`: what a policy wants of Slurm (pure), the parsing of what Slurm
holds (real command output from the local cluster, Slurm 22.05), and the CLI's wiring over a
recording runner. The Slurm tier (tests/slurm/test_policy_enforce.py) runs it for real."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from slurm_etc.cli.main import cli
from slurm_etc.policy.admin import AdminVerdict
from slurm_etc.policy.enforce import (
    AccountHolds,
    NodeLimits,
    PartitionHolds,
    account_changes,
    check_account,
    check_partition,
    needs_attention,
    partition_changes,
)
from slurm_etc.policy.rules import PolicyError, ResizePolicy, Scope
from slurm_etc.slurm.limits import (
    parse_config,
    parse_partitions,
    parse_qos,
    parse_user_assocs,
    tres_nodes,
)
from slurm_etc.slurm.runner import Result

SCAVENGE = Scope("partition", "scavenge")
ACCOUNT = Scope("account", "proj")
QOS = "slurm-etc-partition-scavenge"
BARE = PartitionHolds(None, 30, None)
HELD = PartitionHolds(QOS, 30, NodeLimits(4, 4))

PARTITIONS = (
    "PartitionName=main AllowGroups=ALL AllowQos=ALL Default=YES QoS=N/A DefaultTime=NONE "
    "GraceTime=0 Hidden=NO MaxNodes=UNLIMITED Nodes=n[1-4] PriorityTier=5 State=UP "
    "TRES=cpu=16,mem=16G,node=4,billing=16,gres/gpu=8\n"
    f"PartitionName=scavenge AllowGroups=ALL AllowQos=ALL Default=NO QoS={QOS} "
    "GraceTime=10 Hidden=NO Nodes=n[1-4] PriorityTier=1 PreemptMode=REQUEUE State=UP\n")
CONFIG = ("Configuration data as of 2026-12-06T17:00:00\n"
          "AccountingStorageEnforce = associations,limits,qos\n"
          "ClusterName             = slurmetc\n")


def kinds(changes):
    return [(c.argv[0], c.argv[2]) for c in changes]


def test_a_partition_policy_becomes_its_qos():
    policy = ResizePolicy(max_nodes=4, preempt_grace_s=60)
    changes = partition_changes(SCAVENGE, policy, BARE)
    assert kinds(changes) == [("sacctmgr", "add"), ("sacctmgr", "modify"),
                              ("scontrol", "PartitionName=scavenge"),
                              ("scontrol", "PartitionName=scavenge")]
    assert "MaxTRESPerUser=node=4" in changes[1].argv
    assert "MaxTRESPerJob=node=4" in changes[1].argv
    assert changes[2].argv[-1] == f"QOS={QOS}"
    assert changes[3].argv[-1] == "GraceTime=60"
    # held already: nothing; a changed limit: only the modify
    assert partition_changes(SCAVENGE, ResizePolicy(max_nodes=4), HELD) == []
    (modify,) = partition_changes(SCAVENGE, ResizePolicy(max_nodes=2), HELD)
    assert "MaxTRESPerUser=node=2" in modify.argv


def test_no_policy_takes_our_qos_off_and_a_sites_qos_is_refused():
    off = partition_changes(SCAVENGE, None, HELD)
    assert [c.argv[-1] for c in off] == ["QOS=", QOS]
    assert off[1].argv[:4] == ("sacctmgr", "-i", "delete", "qos")
    assert partition_changes(SCAVENGE, ResizePolicy(min_nodes=1), BARE) == []
    with pytest.raises(PolicyError, match="has QOS gpu-users, not slurm-etc's"):
        partition_changes(SCAVENGE, ResizePolicy(max_nodes=4),
                          PartitionHolds("gpu-users", 30, None))


def test_an_account_policy_binds_each_user_association():
    holds = AccountHolds((("alice", NodeLimits()), ("bob", NodeLimits(4, 4))))
    (change,) = account_changes(ACCOUNT, ResizePolicy(max_nodes=4), holds, "c1")
    assert change.argv == ("sacctmgr", "-i", "modify", "user", "where", "account=proj",
                           "cluster=c1", "set", "GrpTRES=node=4", "MaxTRES=node=4")
    same = AccountHolds((("alice", NodeLimits(4, 4)),))
    assert account_changes(ACCOUNT, ResizePolicy(max_nodes=4), same, "c1") == []
    (clear,) = account_changes(ACCOUNT, None, same, "c1")
    assert clear.argv[-2:] == ("GrpTRES=node=-1", "MaxTRES=node=-1")


def test_check_says_what_slurm_holds_and_what_only_the_coordinator_does():
    policy = ResizePolicy(max_nodes=4, preempt_grace_s=30, allowed_tp=(1, 2))
    rows = {f.field: f for f in check_partition(SCAVENGE, policy, HELD, True)}
    assert {k: r.state for k, r in rows.items()} == {
        "max_nodes": "enforced", "preempt_grace_s": "enforced", "allowed_tp": "coordinator only"}
    assert not needs_attention(list(rows.values()))
    drifted = check_partition(SCAVENGE, ResizePolicy(max_nodes=3), HELD, True)
    assert drifted[0].state == "drift" and drifted[0].slurm == "4 nodes"
    unenforced = check_partition(SCAVENGE, ResizePolicy(max_nodes=4), HELD, False)
    assert unenforced[0].state == "not enforced" and needs_attention(unenforced)
    site = check_partition(SCAVENGE, ResizePolicy(max_nodes=4),
                           PartitionHolds("gpu-users", 0, None), True)
    assert site[0].state == "conflict"
    assert check_partition(SCAVENGE, None, HELD, True)[0].state == "drift"
    assert check_partition(SCAVENGE, None, BARE, True) == []
    mixed = AccountHolds((("alice", NodeLimits(4, 4)), ("bob", NodeLimits())))
    (acct,) = check_account(ACCOUNT, ResizePolicy(max_nodes=4), mixed, True)
    assert acct.state == "drift" and acct.slurm == "- / 4 nodes"
    grace = check_account(ACCOUNT, ResizePolicy(preempt_grace_s=30), mixed, True)
    assert [(f.field, f.state) for f in grace] == [("preempt_grace_s", "coordinator only")]


def test_parsers_read_slurms_own_output():
    assert tres_nodes("cpu=4,node=2,gres/gpu=8") == 2 and tres_nodes("") is None
    assert tres_nodes("billing=12") is None
    config = parse_config(CONFIG)
    assert config.cluster == "slurmetc" and config.limits_enforced
    assert not parse_config("AccountingStorageEnforce = associations\n").limits_enforced
    assert parse_partitions(PARTITIONS) == {"main": (None, 0), "scavenge": (QOS, 10)}
    assert parse_qos(f"normal|||\n{QOS}|node=2|node=3|\n") == {
        "normal": NodeLimits(), QOS: NodeLimits(2, 3)}
    assert parse_user_assocs("|||\nroot|node=1|node=1\nbob||\n") == AccountHolds(
        (("bob", NodeLimits()), ("root", NodeLimits(1, 1))))


class RecordingRunner:
    """Slurm's answers by command; records what was run."""

    def __init__(self, qos: str = "normal|||\n", assoc: str = "alice||\n"):
        self.answers = {"show config": CONFIG, "show partition": PARTITIONS.replace(QOS, "N/A"),
                        "show qos": qos, "show assoc": assoc}
        self.ran: list[tuple[str, ...]] = []

    def run(self, cmd, **_):
        for key, out in self.answers.items():
            if key in " ".join(cmd.argv):
                return Result(0, out, "", 0.0)
        self.ran.append(cmd.argv)
        return Result(0, "", "", 0.0)


def invoke(tmp_path, runner, *args, admin=True):
    obj = {"slurm_runner": runner,
           "admin_check": lambda: AdminVerdict(admin, "test", "admin" if admin else "bob")}
    return CliRunner().invoke(cli, ["policy", "--db", str(tmp_path / "p.db"), *args], obj=obj)


def test_the_cli_applies_checks_and_refuses(tmp_path):
    runner = RecordingRunner()
    assert invoke(tmp_path, runner, "set", "--partition", "scavenge", "max_nodes=2").exit_code == 0
    assert invoke(tmp_path, runner, "set", "--account", "proj", "max_nodes=3").exit_code == 0
    check = invoke(tmp_path, runner, "check", "--json")
    assert check.exit_code == 1, check.output
    states = {(f["scope"], f["state"]) for f in json.loads(check.output)["findings"]}
    assert states == {("partition:scavenge", "drift"), ("account:proj", "drift")}

    dry = invoke(tmp_path, runner, "apply", "--dry-run")
    assert dry.exit_code == 0 and runner.ran == [] and dry.output.count("would run:") == 4
    denied = invoke(tmp_path, runner, "apply", admin=False)
    assert denied.exit_code == 2 and runner.ran == [] and "permission denied" in denied.output
    done = invoke(tmp_path, runner, "apply", "--json")
    assert done.exit_code == 0, done.output
    assert [argv[:3] for argv in runner.ran] == [
        ("sacctmgr", "-i", "add"), ("sacctmgr", "-i", "modify"), ("scontrol", "update",
         "PartitionName=scavenge"), ("sacctmgr", "-i", "modify")]
    assert json.loads(done.output)["applied"] is True

    # a site's QOS on the partition: one line, exit 2, nothing run
    runner = RecordingRunner()
    runner.answers["show partition"] = PARTITIONS.replace(QOS, "gpu-users")
    refused = invoke(tmp_path, runner, "apply")
    assert refused.exit_code == 2 and runner.ran == [], refused.output
    assert "has QOS gpu-users" in refused.output and "nothing changed" in refused.output
    # an unknown partition in the policy: one line, exit 2
    invoke(tmp_path, runner, "set", "--partition", "nosuch", "max_nodes=2")
    unknown = invoke(tmp_path, runner, "apply", "--partition", "nosuch")
    assert unknown.exit_code == 2 and "no such partition" in unknown.output
