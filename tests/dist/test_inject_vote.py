"""A worker dying inside the commit vote never splits the survivors.

The commit vote is an allgather; a rank that dies inside it (its own vote sent, the outcome
not known) can leave the survivors with different views of it: some got every OK vote,
some an error. The rule: the decision is made once (the first view recorded under one key of
the rendezvous store, which the coordinator hosts) and every survivor follows it.

Real processes (spawned), a real TCPStore hosted by the test process (the coordinator's
role), migration groups connected from it as a resize connects them, the real executor.
Device 0 leaves, device 1 stays, device 2 joins. Each case checks that every surviving rank
ends the same way (all committed with correct shards, or all aborted) and as the recorded
decision says.

The checker is shown to catch a split: with the decision switched off, a rank whose view of
the vote failed (``lose_vote``: the split a death inside the vote can cause, made
deterministic) aborts while the others commit.

As a resize decides (``megatron/resize.py``): only the group's rank 0 asks the store when it
saw every vote OK, and every rank shares what it got over the migration group
(``decide="share"``); where the share fails (a peer killed) each asks the store. Cases where
rank 0 itself loses its view or is killed; a planted bug, ranks that do not follow what was
shared (each its own view), is caught.
"""
from __future__ import annotations

import multiprocessing
import os
import socket
from datetime import timedelta

import pytest

from slurm_etc.migrate.decision import CommitDecision

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


class OwnView(CommitDecision):
    """The planted bug: a rank that saw every vote OK shares, then commits on its own view,
    whatever the others shared."""

    def __call__(self, saw_commit: bool, data_s: float = 0.0) -> bool:
        if self.proposer or not saw_commit:
            return super().__call__(saw_commit, data_s)
        assert self.share is not None
        self.share(0, 0)
        return saw_commit


def _plan():
    from slurm_etc.plan import Layout, ParallelConfig, Topology, plan_migration
    from slurm_etc.plan.model import PRESETS

    cfg = ParallelConfig(1, 1, 2, distributed_optimizer=True)
    return plan_migration(PRESETS["tiny-llama"], Layout(cfg, (0, 1)), cfg, (1, 2),
                          Topology(gpus_per_node=4))


def _worker(device: int, port: int, case: str, faults, decide: bool | str, out) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    from slurm_etc.migrate.decision import shared_over
    from slurm_etc.migrate.executor import MigrationAborted, MigrationOptions, execute_migration
    from slurm_etc.migrate.group import connect_migration_group
    from slurm_etc.testing.fake_state import fake_shards, shard_mismatches

    torch.set_num_threads(1)
    try:
        plan = _plan()
        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=timedelta(seconds=60))
        group = connect_migration_group(plan, device, dist.PrefixStore(f"{case}/migrate", store),
                                        timeout_s=60)
        old_rank = plan.old.devices.index(device) if device in plan.old.devices else None
        transport = group.transport()
        commit = None
        if decide == "store" or decide is True:
            commit = CommitDecision(store, f"{case}/commit")
        elif decide in ("share", "own-view", "own-data"):
            kind = OwnView if decide == "own-view" else CommitDecision
            share = shared_over(transport, 10.0)
            if decide == "own-data":  # planted: each rank's own data phase, not the longest
                share = (lambda real: lambda v, d: (real(v, d)[0], d))(share)
            commit = kind(store, f"{case}/commit", share=share,
                          proposer=device == 0)  # group rank = device here
        try:
            res = execute_migration(plan, transport, device,
                                    fake_shards(plan, old_rank),
                                    options=MigrationOptions(timeout_s=10,
                                                             measure_memory=False),
                                    faults=faults, commit=commit)
        except MigrationAborted as exc:
            out.put((device, {"outcome": "aborted", "error": str(exc)[:300]}))
        else:
            out.put((device, {"outcome": "committed",
                              "mismatches": shard_mismatches(plan, res.new_rank,
                                                             res.new_shards),
                              "data_s": res.stats.data_seconds,
                              "longest": getattr(commit, "longest_data_s", None)}))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        out.put((device, {"outcome": "error", "error": repr(exc)}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def store():
    import torch.distributed as dist

    port = _free_port()
    s = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=60))
    yield s, port
    del s


def _run(store, case: str, faults_of, decide: bool | str = True, dead: int | None = None):
    """Run the migration on devices 0, 1, 2 (``faults_of(device)`` each); returns the
    survivors' results and the recorded decision."""
    s, port = store
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = {d: ctx.Process(target=_worker, args=(d, port, case, faults_of(d), decide, out))
             for d in (0, 1, 2)}
    for p in procs.values():
        p.start()
    try:
        results = dict(out.get(timeout=180) for d in procs if d != dead)
    finally:
        for p in procs.values():
            p.join(30)
            if p.is_alive():
                p.kill()
    if dead is not None:
        assert procs[dead].exitcode == -9, procs[dead].exitcode  # SIGKILL, by itself
    decision = s.get(f"{case}/commit").decode() if decide and s.check([f"{case}/commit"]) \
        else None
    return results, decision


def _no_split(results: dict, decision: str | None) -> str:
    """Every survivor ended the same way, as the recorded decision says; committed ranks
    hold correct shards. Returns the outcome."""
    outcomes = {d: r["outcome"] for d, r in results.items()}
    assert "error" not in outcomes.values(), results
    assert len(set(outcomes.values())) == 1, f"split: {outcomes}"
    outcome = next(iter(outcomes.values()))
    assert decision == {"committed": "commit", "aborted": "abort"}[outcome], (decision, outcome)
    for d, r in results.items():
        if outcome == "committed":
            assert r["mismatches"] == [], (d, r["mismatches"])
    return outcome


def _injector(rank: int | None = None, *, kill: str | None = None, lose: bool = False):
    from slurm_etc.migrate.faults import FaultInjector

    def of(device: int):
        f = FaultInjector()
        if device == rank:
            if kill:
                f = f.kill(device, kill)  # group rank = device here: participants (0, 1, 2)
            if lose:
                f = f.lose_vote(device)
        return f
    return of


@pytest.mark.parametrize("victim", [2, 0])
def test_view_of_the_vote_lost_no_split(store, victim):
    """One rank's view of the commit vote fails, the others' does not: all follow one
    decision (the first recorded: whichever rank proposed first)."""
    results, decision = _run(store, f"lost-{victim}", _injector(victim, lose=True))
    _no_split(results, decision)


def test_planted_own_view_splits(store):
    """The checker catches a split: without the one decision, the rank whose view failed
    aborts while the others commit."""
    results, decision = _run(store, "planted", _injector(2, lose=True), decide=False)
    outcomes = {d: r["outcome"] for d, r in results.items()}
    assert outcomes == {0: "committed", 1: "committed", 2: "aborted"}, outcomes
    with pytest.raises(AssertionError, match="split"):
        _no_split(results, decision)


@pytest.mark.parametrize("victim", [2, 1])
def test_killed_inside_the_vote_no_split(store, victim):
    """A rank SIGKILLed inside the commit vote (its vote sent): the survivors end alike."""
    results, decision = _run(store, f"kill-{victim}", _injector(victim, kill="in-vote"),
                             dead=victim)
    assert sorted(results) == sorted({0, 1, 2} - {victim})
    _no_split(results, decision)


@pytest.mark.parametrize("how", ["lost", "killed"])
def test_with_the_decision_shared_rank_0_losing_its_view_or_killed_no_split(store, how):
    """Rank 0 asks the store for all: its view of the vote lost, it proposes abort and every
    rank follows what it shared; killed inside the vote, the share fails and each survivor
    asks the store."""
    faults = _injector(0, lose=True) if how == "lost" else _injector(0, kill="in-vote")
    results, decision = _run(store, f"share-{how}", faults, decide="share",
                             dead=0 if how == "killed" else None)
    assert _no_split(results, decision) == "aborted" or how == "killed"


def test_shared_and_not_followed_splits(store):
    """The checker catches a split where the shared decision is not followed: rank 0's view
    lost, it aborts while the others commit on their own view."""
    results, decision = _run(store, "share-planted", _injector(0, lose=True), decide="own-view")
    outcomes = {d: r["outcome"] for d, r in results.items()}
    assert outcomes == {0: "aborted", 1: "committed", 2: "committed"}, outcomes
    with pytest.raises(AssertionError, match="split"):
        _no_split(results, decision)


def _longest_shared(results: dict) -> float:
    """Every rank learned, from the decision's share, the group's longest data phase (what
    the proposer reports for all): the maximum of the ranks' own, to the microsecond."""
    want = max(r["data_s"] for r in results.values())
    got = {d: r["longest"] for d, r in results.items()}
    assert all(v is not None and abs(v - want) <= 1e-6 for v in got.values()), (want, got)
    return want


def test_the_share_gives_every_rank_the_longest_data_phase(store):
    """Nothing fails: every rank commits and knows the group's longest data phase, so the
    proposer answers the coordinator for all (one message, not one a rank)."""
    results, decision = _run(store, "share-longest", _injector(), decide="share")
    assert _no_split(results, decision) == "committed"
    assert _longest_shared(results) > 0


def test_a_share_without_the_maximum_is_caught(store):
    """Planted: the share hands each rank back its own data phase; the check above fails."""
    results, decision = _run(store, "share-own-data", _injector(), decide="own-data")
    assert _no_split(results, decision) == "committed"
    with pytest.raises(AssertionError):
        _longest_shared(results)
