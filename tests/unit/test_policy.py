"""Policy rules, the admin check and decide(): worked scenarios with their reasons."""
import pytest

from slurm_etc.alloc import ClusterTopology, Device, Hardware, TrainingJob, identity_layout
from slurm_etc.alloc.topology import format_devices
from slurm_etc.plan import PRESETS
from slurm_etc.policy import (
    JobView,
    Notice,
    Pause,
    PolicyError,
    Release,
    RequestGrow,
    ResizeDecision,
    ResizePolicy,
    Scope,
    decide,
    effective,
    parse_assignments,
)
from slurm_etc.policy.admin import SacctmgrAnswer, adminlevel, adminlevel_command, verdict
from slurm_etc.policy.rules import EffectivePolicy, check_keys, updated

pytestmark = pytest.mark.unit

# ---- rules -----------------------------------------------------------------------------


def test_parse_assignments_accepts_every_field():
    got = parse_assignments(["min_nodes=2", "max-nodes=32", "allowed_tp=8,2,4", "grow=no",
                             "grow_partition=preempt", "grow_qos=scavenger",
                             "preempt_grace_s=2m", "max_resizes_per_hour=6", "allowed_pp=1"])
    policy = ResizePolicy(**got)
    assert policy.allowed_tp == (2, 4, 8) and policy.preempt_grace_s == 120
    assert policy.grow is False and policy.max_nodes == 32


@pytest.mark.parametrize("items, message", [
    (["foo=1"], "unknown policy key 'foo'; valid keys: min_nodes, max_nodes"),
    (["min_nodes"], "expected key=value"),
    (["min_nodes=two"], "min_nodes must be an integer, got 'two'"),
    (["allowed_tp=2,x"], "allowed_tp must be a comma list of integers"),
    (["grow=maybe"], "grow must be yes or no"),
    (["preempt_grace_s=soon"], "preempt_grace_s must be seconds"),
    (["min_nodes=1", "min_nodes=2"], "given twice"),
])
def test_parse_assignments_rejects_with_the_valid_choices(items, message):
    with pytest.raises(PolicyError, match=message):
        parse_assignments(items)


@pytest.mark.parametrize("fields, message", [
    (dict(min_nodes=0), "min_nodes must be an integer >= 1"),
    (dict(min_nodes=4, max_nodes=2), r"min_nodes \(4\) must not exceed max_nodes \(2\)"),
    (dict(allowed_tp=()), "allowed_tp must be a non-empty list"),
    (dict(allowed_pp=(0, 2)), "allowed_pp must be a non-empty list of positive integers"),
    (dict(grow_partition="bad name"), "is not a Slurm name"),
    (dict(preempt_grace_s=-1), "preempt_grace_s must be an integer >= 0"),
])
def test_invalid_policies_are_rejected(fields, message):
    with pytest.raises(PolicyError, match=message):
        ResizePolicy(**fields)


def test_scope_and_key_validation():
    with pytest.raises(PolicyError, match="must be one of partition, account"):
        Scope("qos", "x")
    with pytest.raises(PolicyError, match="not a Slurm name"):
        Scope("partition", "a b")
    assert check_keys(["min-nodes", "grow"]) == ["min_nodes", "grow"]
    with pytest.raises(PolicyError, match="unknown policy key 'nope'"):
        check_keys(["nope"])
    with pytest.raises(PolicyError, match=r"min_nodes \(8\) must not exceed"):
        updated(ResizePolicy(max_nodes=4), {"min_nodes": 8})


def test_effective_policy_takes_the_stricter_value():
    part = (Scope("partition", "gpu"), ResizePolicy(min_nodes=2, max_nodes=32,
                                                     allowed_tp=(2, 4, 8), grow_qos="low",
                                                     preempt_grace_s=60,
                                                     max_resizes_per_hour=6))
    acct = (Scope("account", "ml"), ResizePolicy(max_nodes=16, allowed_tp=(4, 8, 16),
                                                  grow=False, grow_qos="ml",
                                                  preempt_grace_s=120))
    got = effective([part, acct])
    assert got == EffectivePolicy(min_nodes=2, max_nodes=16, allowed_tp=(4, 8), grow=False,
                                  grow_qos="ml", preempt_grace_s=120, max_resizes_per_hour=6)
    assert effective([]) == EffectivePolicy()


def test_contradicting_policies_name_both_scopes():
    with pytest.raises(PolicyError,
                       match=r"allowed_tp of account:ml \(4\) and of partition:gpu \(2\)"):
        effective([(Scope("partition", "gpu"), ResizePolicy(allowed_tp=(2,))),
                   (Scope("account", "ml"), ResizePolicy(allowed_tp=(4,)))])
    with pytest.raises(PolicyError, match="min_nodes 8 .from partition:gpu. exceeds "
                                          "max_nodes 4 .from account:ml."):
        effective([(Scope("partition", "gpu"), ResizePolicy(min_nodes=8)),
                   (Scope("account", "ml"), ResizePolicy(max_nodes=4))])


# ---- admin check -----------------------------------------------------------------------


def test_admin_verdicts():
    assert adminlevel_command("alice") == ["sacctmgr", "-nP", "show", "user", "alice",
                                           "format=user,adminlevel"]
    assert adminlevel_command("alice", "/usr/bin/sacctmgr")[0] == "/usr/bin/sacctmgr"
    root = verdict("root", 0, None)
    assert root.allowed and root.user == "root"
    admin = verdict("alice", 1000, SacctmgrAnswer("alice|Administrator\n"))
    assert admin.allowed and admin.reason == "Slurm Administrator" and admin.user == "alice"
    assert verdict("alice", 1000, SacctmgrAnswer("alice|Operator\n")).allowed
    # Slurm keeps user names in lower case
    assert verdict("Alice", 1000, SacctmgrAnswer("alice|Operator\n")).allowed
    no = verdict("alice", 1000, SacctmgrAnswer("alice|None\n"))
    assert not no.allowed and "AdminLevel None" in no.reason and no.user == "alice"
    assert "no accounting record" in verdict("alice", 1000, SacctmgrAnswer("")).reason
    # an answer about someone else is no answer about alice
    other = verdict("alice", 1000, SacctmgrAnswer("admin|Administrator\n"))
    assert not other.allowed and "no accounting record" in other.reason
    failed = verdict("alice", 1000, SacctmgrAnswer(problem="/usr/bin/sacctmgr exited with "
                                                           "code 1: cannot reach slurmdbd"))
    assert not failed.allowed
    assert failed.reason == ("alice is not root and Slurm's admin level cannot be checked "
                             "(/usr/bin/sacctmgr exited with code 1: cannot reach slurmdbd); "
                             "only root may change policies")
    assert "sacctmgr was not asked" in verdict("alice", 1000, None).reason
    nameless = verdict(None, 4242, None)
    assert not nameless.allowed and "uid 4242 has no user name" in nameless.reason
    assert adminlevel("bob", "alice|Administrator\nbob|None\n") == "None"
    assert adminlevel("bob", "Administrator\n") == ""


# ---- decide ----------------------------------------------------------------------------

TOPO = ClusterTopology.uniform(16, 8, nodes_per_switch=8)
JOB = TrainingJob(PRESETS["llama-7b"], global_batch=1024)
HW = Hardware()


def whole(*indices):
    return frozenset(d for i in indices for d in TOPO.devices_of(TOPO.nodes[i]))


def fake_cost(layout, config, allocation):
    """Bytes that change device: a cheap, deterministic stand-in for the planner."""
    return len(set(allocation.vranks) ^ set(layout.devices))


def started(held, policy=EffectivePolicy()):
    d = decide(JobView(0.0, JOB, HW, TOPO, held), policy, cost=fake_cost)
    resize = next(a for a in d.actions if isinstance(a, ResizeDecision))
    return resize, identity_layout(resize.config, resize.allocation.pool)


def test_start_uses_a_valid_configuration_and_releases_the_rest():
    held = whole(0, 1, 2, 3, 4) | {Device(TOPO.nodes[5], i) for i in range(3)}
    d = decide(JobView(0.0, JOB, HW, TOPO, held), EffectivePolicy(), cost=fake_cost)
    resize, release = d.actions[0], d.actions[1]
    assert isinstance(resize, ResizeDecision) and not resize.forced
    assert resize.config.world == 32 and "start:" in resize.reason
    assert isinstance(release, Release) and len(release.devices) == 11
    assert "cannot join whole tensor-parallel groups" in release.reason
    assert all("\n" not in str(a) for a in d.actions)


def test_a_loss_forces_a_resize_even_at_the_resize_cap():
    resize, layout = started(whole(0, 1, 2, 3))
    policy = EffectivePolicy(max_resizes_per_hour=1, preempt_grace_s=120)
    lost = whole(3)
    snap = JobView(100.0, JOB, HW, TOPO, whole(0, 1, 2, 3), layout,
                    resize.allocation.vranks, (Notice(lost, 130.0),), resizes=(50.0,))
    d = decide(snap, policy, cost=fake_cost)
    r = d.actions[0]
    assert isinstance(r, ResizeDecision) and r.forced and r.deadline == 130.0
    assert not lost & r.allocation.devices
    assert "8 device(s) lost to preemption (n0003:0-7), 30 s of notice (policy asks for " \
           "120 s)" in r.reason
    # devices that stay keep their vranks
    before = {dev: v for v, dev in resize.allocation.vranks.items()}
    assert all(before[dev] == v for v, dev in r.allocation.vranks.items())


def test_small_gains_do_not_resize_and_unused_grants_are_released():
    resize, layout = started(whole(0, 1, 2, 3))
    grant = {Device(TOPO.nodes[9], i) for i in range(4)}
    snap = JobView(10.0, JOB, HW, TOPO, whole(0, 1, 2, 3) | grant, layout,
                    resize.allocation.vranks)
    d = decide(snap, EffectivePolicy(grow=False), cost=fake_cost)
    assert d.reason.startswith(f"keep {layout.config}")
    assert [type(a) for a in d.actions] == [Release]
    assert set(d.actions[0].devices) == grant


def test_a_worthwhile_grow_waits_for_the_resize_cap():
    resize, layout = started(whole(0, 1, 2, 3))
    held = whole(0, 1, 2, 3, 4, 5, 6, 7)
    vranks = resize.allocation.vranks
    capped = decide(JobView(3000.0, JOB, HW, TOPO, held, layout, vranks,
                             resizes=(1000.0, 2000.0)),
                    EffectivePolicy(max_resizes_per_hour=2), cost=fake_cost)
    assert "reach the policy cap (2)" in capped.reason
    assert not any(isinstance(a, ResizeDecision) for a in capped.actions)
    later = decide(JobView(5000.0, JOB, HW, TOPO, held, layout, vranks,
                            resizes=(1000.0, 2000.0)),
                   EffectivePolicy(max_resizes_per_hour=2), cost=fake_cost)
    grow = later.actions[0]
    assert isinstance(grow, ResizeDecision) and grow.config.world == 64 and not grow.forced
    assert grow.reason.startswith("+")


def test_grow_requests_follow_the_policy():
    resize, layout = started(whole(0, 1, 2, 3))
    snap = JobView(10.0, JOB, HW, TOPO, whole(0, 1, 2, 3), layout, resize.allocation.vranks)
    policy = EffectivePolicy(grow_partition="preempt", grow_qos="scavenger",
                             preempt_grace_s=90)
    d = decide(snap, policy, cost=fake_cost)
    (grow,) = [a for a in d.actions if isinstance(a, RequestGrow)]
    assert grow.nodes == 4 and grow.partition == "preempt" and grow.signal_grace_s == 90
    assert "request 4 more node(s) in partition preempt with QOS scavenger, warned 90 s" \
        in str(grow)
    assert not any(isinstance(a, RequestGrow) for a in decide(
        snap, EffectivePolicy(grow=False), cost=fake_cost).actions)
    assert not any(isinstance(a, RequestGrow) for a in decide(
        snap, EffectivePolicy(max_nodes=4), cost=fake_cost).actions)
    pending = JobView(10.0, JOB, HW, TOPO, whole(0, 1, 2, 3), layout,
                       resize.allocation.vranks, growing=4)
    assert not any(isinstance(a, RequestGrow) for a in decide(
        pending, policy, cost=fake_cost).actions)


def test_max_nodes_and_allowed_degrees_bound_the_configuration():
    held = whole(*range(12))
    resize, _ = started(held, EffectivePolicy(max_nodes=4, allowed_tp=(2,), allowed_pp=(4,)))
    assert len(resize.allocation.nodes) <= 4
    assert resize.config.tp == 2 and resize.config.pp == 4


def test_below_min_nodes_the_job_pauses():
    d = decide(JobView(0.0, JOB, HW, TOPO, whole(0)), EffectivePolicy(min_nodes=2),
               cost=fake_cost)
    assert isinstance(d.actions[0], Pause) and "min_nodes (2)" in str(d.actions[0])
    none = decide(JobView(0.0, JOB, HW, TOPO, frozenset()), EffectivePolicy(),
                  cost=fake_cost)
    assert isinstance(none.actions[0], Pause) and "no parallel configuration" in \
        none.actions[0].reason
    assert isinstance(none.actions[1], RequestGrow)


def test_anchor_devices_are_never_released():
    anchor = whole(5)
    d = decide(JobView(0.0, JOB, HW, TOPO, whole(0, 1, 2, 3, 4, 5), pinned=anchor),
               EffectivePolicy(), cost=fake_cost)
    resize = d.actions[0]
    assert anchor <= resize.allocation.devices
    assert not anchor & set(d.actions[1].devices)


def test_decide_asks_the_planner_by_default():
    tiny = TrainingJob(PRESETS["tiny"], global_batch=64)
    start = decide(JobView(0.0, tiny, HW, TOPO, whole(0, 1)), EffectivePolicy()).actions[0]
    layout = identity_layout(start.config, start.allocation.pool)
    snap = JobView(5.0, tiny, HW, TOPO, whole(0, 1), layout, start.allocation.vranks,
                    (Notice(whole(1), 5.0, "failure"),))
    resize = decide(snap, EffectivePolicy()).actions[0]
    assert resize.forced and resize.allocation.devices <= whole(0)
    assert "8 device(s) lost to failure (n0001:0-7)" in resize.reason


def test_format_devices_merges_ranges():
    devs = [Device("n1", 0), Device("n1", 1), Device("n1", 2), Device("n1", 5), Device("n2", 7)]
    assert format_devices(devs) == "n1:0-2+5,n2:7"


def test_a_loss_with_nothing_else_usable_rides_out_the_notice_of_the_survivors():
    # soak seed 201: the layout spans two nodes; one fails while the other is under notice.
    # Its state lives only on the noticed node: the job resizes onto it until the notice
    # runs out (a grant meanwhile takes it up), it does not pause with the state at risk
    tiny = TrainingJob(PRESETS["tiny"], global_batch=64)
    policy = EffectivePolicy(allowed_tp=(4,))
    start = decide(JobView(0.0, tiny, HW, TOPO, whole(0, 1)), policy).actions[0]
    assert start.allocation.devices == whole(0, 1)
    layout = identity_layout(start.config, start.allocation.pool)
    notices = (Notice(whole(0), 5.0, "failure"), Notice(whole(1), 200.0))
    d = decide(JobView(10.0, tiny, HW, TOPO, whole(0, 1), layout, start.allocation.vranks,
                       notices), policy)
    resize = d.actions[0]
    assert isinstance(resize, ResizeDecision) and resize.forced and resize.deadline == 200.0
    assert resize.allocation.devices <= whole(1) and resize.config.world <= 8
    assert "until their notice runs out" in resize.reason and "gone" in d.reason
    # once on the noticed node, nothing gone: it pauses there (no resize onto itself again)
    on1 = identity_layout(resize.config, resize.allocation.pool)
    again = decide(JobView(20.0, tiny, HW, TOPO, whole(1), on1, resize.allocation.vranks,
                           (Notice(whole(1), 200.0),)), policy)
    assert not any(isinstance(a, ResizeDecision) for a in again.actions)
    assert any(isinstance(a, Pause) for a in again.actions)
    # nothing gone (only a notice) and nothing usable: a pause, as before
    noticed = decide(JobView(10.0, tiny, HW, TOPO, whole(0, 1), layout,
                             start.allocation.vranks, (Notice(whole(0, 1), 200.0),)), policy)
    assert not any(isinstance(a, ResizeDecision) for a in noticed.actions)
