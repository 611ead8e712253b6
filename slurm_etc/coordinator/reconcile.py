"""The reconcile loop's decisions on a resize in flight, as pure functions.

``settle(resize, now, worker_timeout_s)`` reads what the workers said about an ordered
resize and says what happens next; :class:`~.loop.Coordinator` only carries it out (records
it, tells the workers, stops the idle). No I/O here, no clock: the caller passes ``now``
(``time.monotonic()`` seconds, the clock of ``started`` and ``sent_at``). Unit tests call
these directly (tests/unit/test_reconcile.py).

The resize in flight (:class:`InflightResize`) is frozen: what the workers say of it gives a
new value (``died``, ``answered``, ``became_ready``, ``replayed``, ``told``, ``ordered``) that
replaces the old one; ``may_order`` says when its old layout is ordered (every joiner Ready,
none dead) and ``owes_order`` whether a worker that said Hello still needs the order. What a
message changes is persistent (:class:`VrankSet`, :class:`VrankMap`, :class:`Replays`, on
``immutables.Map``, a hash array mapped trie): the new value shares all but O(log n) of the
old one, and none of these functions looks at every vrank, so a message costs the coordinator
about as much at 16,384 ranks as at 8 (bench/reconcile_scale.py).

``overdue(resize, unjoined, now, ...)`` gives up the launched workers late past the join
timeout of their launch (no Hello: :class:`NeverJoined`; a joiner's Hello but no Ready:
:class:`NeverReady`), from ``late_to_join(...)`` and ``late_to_be_ready(...)``;
``supersede(resize, now)`` gives up a grow whose joiners still warm up with nobody paused
(``warming_up(resize)``) when a notice or a loss came: its end recorded, then
:class:`Supersede`.

``commit(holdings, resize, done, wall)`` and ``abort(resize, aborted, wall)`` say what a
settled resize changes in what the job holds (:class:`Holdings`) and the effects that carry
it out, in the order they must happen: the record first (a coordinator killed between two
effects resumes from the record), then what acts on it. The loop performs each
(:func:`.acting.perform_effect`).

``order_resize(holdings, decision, ...)`` turns the policy's decision into the resize to
order: the vranks (a leaving device's never given to another), the plan, the generation, the
joiners, and whether the old layout prepares beside training (a notice's grace must hold
:data:`ASIDE_MARGIN` times the longest such preparation timed so far, and as many times
:data:`ASIDE_STEPS` training steps, and the plan's estimate).

``plan_resize(...)`` plans the next resize, with the fallback for state lost with a device:
a plan that cannot be kept from surviving replicas (``StateLostError``) is planned again as a
rebuild from peer copies or a checkpoint when the job has either, else the job stops.

The settlement's rules:

- **decided**: the resize's commit vote holds commit at the coordinator's store (its first
  value, seen there by ``Coordinator.commit_decided``): committed at once, with the answers
  in so far (every rank voted after its part of the data phase and follows that decision;
  the pause is measured at the step boundaries, and the longest data phase is recorded when
  the late answers came: :class:`LateAnswers`). A rebuild waits for the answers below (the
  steps it lost and where from are the workers');
- **resend**: an order sent more than :data:`RESEND_S` ago goes again to every joiner told
  that has neither answered nor died (a message lost to a reconnect is not a lost resize),
  and from the :data:`STAYER_RESENDS_FROM`-th time on to the old layout's ranks too, until
  a step's decision holds it;
- **a joiner died before the old layout was ordered**: nobody paused; the resize aborts and is
  decided again without its device;
- **a participant died** and the rest have not all answered: :class:`CloseVote`, the loop
  closes the commit vote as abort where no rank decided it (two-phase: nobody installed
  anything) and the job decides again without the dead at once: the survivors, whose
  collectives with the dead failed, wait for the order naming the dead only their own
  timeout, which is shorter than the wait below; a vote that holds commit is waited out;
- **wait** until every live participant answered, or ``2 x worker_timeout_s`` passed (the
  workers' own timeouts fire first: a worker that is silent past twice its timeout is gone);
  where the commit decision's share reached every rank of the migration group, its proposer
  answers for all of them (``Resized.for_group``: one answer a resize, not one a rank; a
  loss too, except a rebuild, which waits for every survivor's answer: the steps it lost);
- **abort** when one participant aborted, the time ran out, or nobody answered; with a dead
  participant the job decides again without it (``retry``); with nobody dead it would abort
  the same way again, so the job stops;
- **commit** otherwise, with the longest pause and data phase any worker measured and, for a
  rebuild, the steps lost and where the lost state came from.
"""
from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import immutables

from slurm_etc.alloc.topology import Device, format_devices
from slurm_etc.lifecycle import ProcessOutcome, ResizeOutcome
from slurm_etc.plan import Layout, MigrationPlan, PlanError, Topology, plan_migration
from slurm_etc.plan.config import ParallelConfig
from slurm_etc.plan.errors import ConfigError, StateLostError
from slurm_etc.plan.fingerprint import plan_digest
from slurm_etc.plan.model import ModelDesc
from slurm_etc.protocol.messages import LayoutSpec, Progress, Resize, Resized, pack_runs

from ..errors import InternalError

logger = logging.getLogger(__name__)

# An order not yet answered is sent again after this long (a worker drops messages older
# than its replay window, e.g. one that sat unread while the worker was blocked; duplicates
# are dropped), then after twice as long each time, up to RESEND_MAX_S: every RESEND_S, a
# 98 s grow at 16,384 simulated ranks sent each unanswered rank its order ~19 times (221,245
# of the grow's 356,423 messages at the coordinator), most to ranks already carrying it out.
RESEND_S = 5.0
# ... and at least this often (half the workers' replay window: a copy that sat unread is
# replaced before a worker would drop it as stale).
RESEND_MAX_S = 60.0
# The old layout's ranks get an unanswered order again only from this resend on (~75 s after
# it went out, then every RESEND_MAX_S), joiners from the first: one rank of the old layout
# told is enough (the step's collectives give the order to the rest), every one was sent it,
# and one not connected then gets it at its Hello; what is left is refreshing a copy before
# the replay window drops it. At 16,384 simulated ranks the resends at 5, 10 and 20 s to the
# whole old layout were 49,000 messages of a grow while its ranks reached their boundary.
STAYER_RESENDS_FROM = 3
# A resize that names no dead goes to this many ranks of the old layout, one a node (those
# that stay first), not to all of them: one rank told is enough, the step's collectives give
# the order to the rest at the boundary that takes it up (worker/agreement.py), so a rank
# more told is a message more at the coordinator and no sooner a pause. More than one: a
# told rank that is slow to read its socket does not hold the order back. An order naming
# the dead goes to every survivor (their collectives with the dead failed: each waits for
# it on its own).
ORDER_COPIES = 4
# A resize under a notice is prepared beside training when the grace left is at least this
# many times the longest preparation beside training measured so far (plus the plan's
# estimate): shared with training, the preparation's time varies with the steps it shares
# the cores with.
ASIDE_MARGIN = 2.0
# Training steps from a resize's order to its pause when it is prepared beside training: the
# step in flight when the order comes, the one the transfer is staged beside, the one after
# the new world's groups, the one after its model (the pause at the boundary after).
ASIDE_STEPS = 4

V = TypeVar("V")
T = TypeVar("T")


class JobStopped(InternalError, RuntimeError):
    """The job cannot go on (one line: why)."""


def plan_resize(model: ModelDesc, old: Layout, config: ParallelConfig, pool: Sequence[int],
                topology: Topology, lost: Sequence[int], lost_devices: str,
                can_rebuild: bool) -> tuple[MigrationPlan, bool]:
    """The plan from ``old`` to ``config`` on ``pool`` with old vranks ``lost`` (whose devices
    ``lost_devices`` names) gone, and whether it is a rebuild: the workers roll back to peer
    copies (a survivor stands in for each lost rank, so the plan is the one with every old
    rank there) or load the last checkpoint. ``can_rebuild``: the job keeps peer copies or
    checkpoints. Raises JobStopped (one line) when neither plan can be made."""
    try:
        return plan_migration(model, old, config, sorted(pool), topology,
                              keep_tp_in_node=True, lost=tuple(lost)), False
    except StateLostError as err:
        if not can_rebuild:
            raise JobStopped(f"devices {lost_devices} failed and their state cannot be "
                             "rebuilt in memory (no peer copies or checkpoints: slurm-etc run "
                             f"--peer-copy-every N / --checkpoint-every M): {err}") from None
        try:
            plan = plan_migration(model, old, config, sorted(pool), topology,
                                  keep_tp_in_node=True)
        except (PlanError, ConfigError) as again:
            raise JobStopped(f"devices {lost_devices} failed and the rebuild from peer copies "
                             f"or a checkpoint cannot be planned: {again}") from None
        return plan, True
    except (PlanError, ConfigError) as err:
        if lost:
            raise JobStopped(f"devices {lost_devices} failed and their state cannot be "
                             f"rebuilt in memory: {err}") from None
        raise


# -- persistent values: a message's change shares all but O(log n) of the value before ------

class VrankSet(Set[int]):
    """A set of vranks never changed in place: ``adding`` gives a new set that shares all but
    O(log n) of this one (an ``immutables.Map``), this one unchanged. Equal to any set of the
    same vranks, and hashed as a frozenset is; ``-``, ``&``, ``|`` with a set give a
    frozenset (once per resize: each is O(n))."""

    __slots__ = ("_map",)

    def __init__(self, vranks: Iterable[int] = ()) -> None:
        self._map: immutables.Map[int, None] = immutables.Map((v, None) for v in vranks)

    @classmethod
    def _on(cls, held: immutables.Map[int, None]) -> VrankSet:
        got = cls.__new__(cls)
        got._map = held
        return got

    @classmethod
    def _from_iterable(cls, it: Iterable[T], /) -> frozenset[T]:
        return frozenset(it)

    def adding(self, *vranks: int) -> VrankSet:
        """This set with ``vranks`` too (itself where it holds them all): O(k log n)."""
        if len(vranks) == 1:
            return self if vranks[0] in self._map else self._on(self._map.set(vranks[0], None))
        grown = self._map.mutate()
        for v in vranks:
            grown[v] = None
        return self if len(grown) == len(self._map) else self._on(grown.finish())

    def __contains__(self, vrank: object) -> bool:
        return vrank in self._map

    def __iter__(self) -> Iterator[int]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)

    def __hash__(self) -> int:
        return self._hash()

    def __repr__(self) -> str:
        return f"VrankSet({sorted(self._map)})"


class VrankMap(Mapping[int, V]):
    """A map from vrank never changed in place: ``setting`` gives a new map that shares all
    but O(log n) of this one (an ``immutables.Map``), this one unchanged. Equal to any
    mapping with the same items, as a dict is."""

    __slots__ = ("_map",)

    def __init__(self, items: Mapping[int, V] | None = None) -> None:
        self._map: immutables.Map[int, V] = immutables.Map(items or {})

    def setting(self, vrank: int, value: V) -> VrankMap[V]:
        """This map with ``vrank`` -> ``value``: O(log n)."""
        got: VrankMap[V] = VrankMap.__new__(VrankMap)
        got._map = self._map.set(vrank, value)
        return got

    def __getitem__(self, vrank: int) -> V:
        return self._map[vrank]

    def __contains__(self, vrank: object) -> bool:
        return vrank in self._map

    def __iter__(self) -> Iterator[int]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, VrankMap):
            return self._map == other._map
        return Mapping.__eq__(self, other)

    def __repr__(self) -> str:
        return f"VrankMap({dict(self._map)!r})"


class Replays(Collection[Progress]):
    """The new layout's steps reported before its resize settled, in the order they came,
    never changed in place: ``appending`` gives a new log that shares all but O(log n) of this
    one (an ``immutables.Map`` by position), this one unchanged. Equal to the tuple of the
    same steps."""

    __slots__ = ("_map",)

    def __init__(self, steps: Iterable[Progress] = ()) -> None:
        self._map: immutables.Map[int, Progress] = immutables.Map(enumerate(steps))

    def appending(self, step: Progress) -> Replays:
        """This log with ``step`` last: O(log n)."""
        got = Replays.__new__(Replays)
        got._map = self._map.set(len(self._map), step)
        return got

    def __iter__(self) -> Iterator[Progress]:
        return (self._map[i] for i in range(len(self._map)))

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, step: object) -> bool:
        return any(s == step for s in self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Replays | tuple):
            return len(self) == len(other) and tuple(self) == tuple(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"Replays({tuple(self)!r})"


# The fields of InflightResize that messages change, and their persistent kinds.
_PERSISTENT: tuple[tuple[str, Any], ...] = (
    ("reports", VrankMap), ("told", VrankSet), ("dead", VrankSet), ("early", Replays),
    ("never_joined", VrankMap), ("ready", VrankSet))


@dataclass(frozen=True)
class InflightResize:
    """A resize ordered and not yet settled. Never changed in place: what the workers say of
    it gives a new value (``died``, ``answered``, ``became_ready``, ``replayed``, ``told``,
    ``ordered``), which replaces the old one, as :class:`Holdings` does. The fields these
    change are persistent, so each costs O(log n), not a copy of every vrank's; a plain set,
    dict or tuple given for one is taken as its persistent kind (once, at construction)."""

    order: Resize
    plan: MigrationPlan
    migration_id: int
    participants: frozenset[int]
    joiners: frozenset[int]
    vranks: Mapping[int, Device]
    release: frozenset[Device]
    started: float
    stayers: frozenset[int] = frozenset()  # the old layout's live vranks: ordered once
    reports: VrankMap[Resized] = field(default_factory=VrankMap)
    told: VrankSet = VrankSet()
    sent_at: float = 0.0  # when the old layout was ordered (0: not yet)
    resends: int = 0  # times the order went again to the told that had not answered
    # a step's decision in the old layout held the order: its ranks read it from the store
    agreed: bool = False
    dead: VrankSet = VrankSet()  # participants whose process died
    rebuild: bool = False  # lost state no replica holds: from peer copies or a checkpoint
    early: Replays = field(default_factory=Replays)  # the new layout's, before settling
    never_joined: VrankMap[str] = field(default_factory=VrankMap)  # joiner -> why (one line)
    decided_at: float = 0.0  # unix seconds: where the preparation before the pause begins
    ready: VrankSet = VrankSet()  # joiners that said Ready
    step_at_launch: int = 0  # the job's step when the joiners were launched
    # the coordinator looked at the commit vote after a death and found it decided commit
    # (or could not close it): the resize is waited out by the rules without a death
    vote_looked_at: bool = False
    # its store's commit vote was decided commit (the coordinator hosts the store and sees
    # the decision's first value): every rank voted after its part of the data phase, and
    # every rank follows that decision, so the resize is committed without an answer a rank
    decided: bool = False
    # the migration group's proposer answered for every rank of it (Resized.for_group)
    whole: bool = False

    def __post_init__(self) -> None:
        for name, kind in _PERSISTENT:
            value = getattr(self, name)
            if type(value) is not kind:
                object.__setattr__(self, name, kind(value))


def died(resize: InflightResize, vrank: int, why: str | None = None) -> InflightResize:
    """``vrank``'s process died (``why``: the line saying why it never joined; the first
    one said stays)."""
    never = resize.never_joined
    if why is not None and vrank not in never:
        never = never.setting(vrank, why)
    return replace(resize, dead=resize.dead.adding(vrank), never_joined=never)


def answered(resize: InflightResize, vrank: int, report: Resized) -> InflightResize:
    """``vrank`` answered the order (``answer``: a commit is final), or for every
    participant (``report.for_group``: the migration group committed; not for a rebuild,
    whose lost steps are every survivor's own word)."""
    return replace(resize, reports=resize.reports.setting(
        vrank, answer(resize.reports.get(vrank), report)),
        whole=resize.whole or (report.for_group and not resize.rebuild and
                               report.outcome == ProcessOutcome.COMMITTED))


def vote_looked_at(resize: InflightResize) -> InflightResize:
    """The commit vote was looked at after a death and holds commit (or cannot be
    closed): the live participants' answers settle it."""
    return replace(resize, vote_looked_at=True)


def decided_commit(resize: InflightResize) -> InflightResize:
    """The commit vote of ``resize`` was decided commit at the coordinator's store."""
    return replace(resize, decided=True)


def became_ready(resize: InflightResize, vrank: int) -> InflightResize:
    """The joiner ``vrank`` said Ready: warmed up, it waits for the old layout."""
    return replace(resize, ready=resize.ready.adding(vrank))


def replayed(resize: InflightResize, report: Progress) -> InflightResize:
    """A step of the rebuilt layout, trained again before the resize settled: it counts once
    settled."""
    return replace(resize, early=resize.early.appending(report))


def first_told(resize: InflightResize) -> frozenset[int]:
    """The old layout's ranks the order of ``resize`` goes to (:data:`ORDER_COPIES`): every
    live one where it names the dead; else the lowest vrank on each of the first
    :data:`ORDER_COPIES` nodes of those that stay in the new layout (any stayers where
    fewer stay). Once a resize: O(stayers)."""
    if resize.order.lost or len(resize.stayers) <= ORDER_COPIES:
        return resize.stayers
    staying = set(resize.order.new.devices)
    chosen: list[int] = []
    nodes: set[str] = set()
    for v in sorted(resize.stayers, key=lambda v: (v not in staying, v)):
        node = resize.vranks[v].node if v in resize.vranks else f"vrank {v}"
        if node not in nodes:
            nodes.add(node)
            chosen.append(v)
            if len(chosen) == ORDER_COPIES:
                break
    return frozenset(chosen)


def told(resize: InflightResize, vrank: int) -> InflightResize:
    """``vrank`` got the order (a joiner, or a worker of the old layout that said Hello after
    the order went out)."""
    return replace(resize, told=resize.told.adding(vrank))


def ordered(resize: InflightResize, got: Collection[int], now: float) -> InflightResize:
    """The order went to the old layout (again, for a resend) at ``now``; ``got``: the
    vranks it reached."""
    return replace(resize, told=resize.told.adding(*got), sent_at=now)


def resent(resize: InflightResize, now: float) -> InflightResize:
    """The order went again (:attr:`Settlement.resend`) at ``now``: the next time waits
    twice as long (:func:`resend_after`)."""
    return replace(resize, sent_at=now, resends=resize.resends + 1)


def agreed(resize: InflightResize) -> InflightResize:
    """A step's decision in the old layout held the order (the store's hook saw it): the
    old layout's ranks are not sent it again; joiners still are, until they answer."""
    return replace(resize, agreed=True)


def resend_after(resends: int) -> float:
    """How long after its last sending an unanswered order goes again, once it went
    ``resends`` times again: :data:`RESEND_S`, doubling, at most :data:`RESEND_MAX_S`."""
    return min(RESEND_S * (1 << min(resends, 16)), RESEND_MAX_S)


def may_order(resize: InflightResize | None, order_after_joined: bool) -> bool:
    """Whether the old layout is ordered now: not yet ordered, and (``order_after_joined``)
    every joiner said Ready and none died (the old layout trains on through the joiners'
    warm-up; one that never gets ready pauses nobody)."""
    if resize is None or resize.sent_at or not resize.stayers:
        return False
    return not order_after_joined or (_all_ready(resize) and not _dead_joiners(resize))


def _all_ready(resize: InflightResize) -> bool:
    # counted first: asked at each Hello and Ready, it looks at each joiner only once as many
    # said Ready as there are joiners (Ready comes from joiners)
    return len(resize.ready) >= len(resize.joiners) and \
        all(v in resize.ready for v in resize.joiners)


def _dead_joiners(resize: InflightResize) -> list[int]:
    # from the dead (few) rather than the joiners (thousands in a grow): asked per message
    return sorted(v for v in resize.dead if v in resize.joiners)


def owes_order(resize: InflightResize | None, vrank: int) -> bool:
    """Whether ``vrank``, which said Hello, still needs the order: a joiner, or a worker of
    the old layout still starting when the order went out."""
    return resize is not None and vrank in resize.participants and \
        vrank not in resize.told and (vrank in resize.joiners or bool(resize.sent_at))


@dataclass(frozen=True)
class Wait:
    """Not settled yet: ask again at the loop's next turn."""


@dataclass(frozen=True)
class Abort:
    """The resize aborted everywhere (two-phase: nobody installed anything)."""

    why: str
    retry: bool  # somebody died: decide again without them; else the job stops


@dataclass(frozen=True)
class CloseVote:
    """A participant died and the rest have not all answered: close the commit vote as
    abort where no rank decided it yet (compare-and-set on the decision's key), then settle
    as ``Abort(why, retry=True)``; where it holds commit, wait (:func:`vote_looked_at`)."""

    why: str


@dataclass(frozen=True)
class Commit:
    """Every live participant committed."""

    pause_s: float
    data_s: float
    lost_steps: tuple[int, int] | None  # a rebuild rolled these steps back
    rebuilt_from: str | None  # where a rebuild took the lost state from
    # the step the state was at when the new layout took it (the ranks' own word: the new
    # layout's first steps may be heard before the commit is; None: nobody said)
    switch_step: int | None = None


Outcome = Wait | CloseVote | Abort | Commit


@dataclass(frozen=True)
class Settlement:
    resend: frozenset[int]  # send the order again to these vranks (empty: nobody)
    outcome: Outcome


def settle(resize: InflightResize, now: float, worker_timeout_s: float) -> Settlement:
    """What happens next to ``resize`` (the rules in the module doc)."""
    if resize.decided and not resize.rebuild:
        # the store's decision is the outcome every rank follows: nothing to wait for (a
        # rebuild waits for an answer: the steps it lost and where from are the workers')
        return Settlement(frozenset(), _committed(resize))
    resend: frozenset[int] = frozenset()
    if resize.sent_at and now - resize.sent_at > resend_after(resize.resends):
        stayers_too = resize.resends >= STAYER_RESENDS_FROM and not resize.agreed
        resend = frozenset(v for v in resize.told
                           if v not in resize.reports and v not in resize.dead
                           and (stayers_too or v not in resize.stayers))
    dead_joiners = _dead_joiners(resize)
    if dead_joiners and not resize.sent_at and resize.stayers:
        why = (resize.never_joined[min(resize.never_joined)] if resize.never_joined else
               f"vrank(s) {', '.join(map(str, dead_joiners))} died before the "
               "old layout was ordered")
        return Settlement(resend, Abort(why, retry=True))
    timed_out = now - resize.started > 2 * worker_timeout_s
    if not timed_out and not _all_answered(resize):
        if resize.dead and not resize.vote_looked_at:
            return Settlement(resend, CloseVote(
                "vrank(s) " + ", ".join(str(v) for v in sorted(resize.dead)) +
                " died in the resize"))
        return Settlement(resend, Wait())
    # settled: what follows runs once per resize
    aborted = [r for r in resize.reports.values() if r.outcome == ProcessOutcome.ABORTED]
    if aborted or timed_out or not resize.reports:
        why = aborted[0].error if aborted else "no answer from " + ", ".join(
            str(v) for v in sorted(resize.participants) if v not in resize.reports)
        return Settlement(resend, Abort(why, retry=bool(resize.dead)))
    return Settlement(resend, _committed(resize))


def _committed(resize: InflightResize) -> Commit:
    """The commit of ``resize`` with the figures of the answers in so far (a resize
    committed from its decision has few or none yet: :class:`LateAnswers` completes its
    data phase; its pause is measured at the step boundaries anyway)."""
    lost_steps, rebuilt_from = rebuilt(resize)
    # a joiner's pause runs from its own order, waiting for the old layout: not training
    # stopped (where only joiners answered, theirs is all there is)
    trained = [r for v, r in resize.reports.items() if v not in resize.joiners] or \
        list(resize.reports.values())
    return Commit(
        pause_s=max((r.pause_seconds for r in trained), default=0.0),
        data_s=max((r.data_seconds for r in resize.reports.values()), default=0.0),
        lost_steps=lost_steps, rebuilt_from=rebuilt_from,
        switch_step=max((r.step for r in resize.reports.values()
                         if r.outcome == ProcessOutcome.COMMITTED), default=None))


@dataclass(frozen=True)
class LateAnswers:
    """The answers still to come to a resize committed from its decision: the longest data
    phase is recorded once all came (one write, not one a rank).

    Attributes:
        generation, migration_id: the resize.
        waiting: participants that had neither answered nor died at its commit.
        recorded: the data phase recorded at its commit.
        longest: the longest data phase of the answers so far.
    """

    generation: int
    migration_id: int
    waiting: int
    recorded: float
    longest: float


def late_answers(resize: InflightResize, done: Commit) -> LateAnswers | None:
    """What is left to hear of ``resize``, committed (``done``) before every participant
    answered; None where none is."""
    waiting = len(resize.participants) - len(resize.reports) - len(resize.dead)
    if waiting <= 0 or resize.whole:
        return None
    return LateAnswers(resize.order.generation, resize.migration_id, waiting, done.data_s,
                       done.data_s)


def late_answer(late: LateAnswers, report: Resized) -> tuple[LateAnswers | None, float | None]:
    """One more answer to the resize of ``late``: what is left to hear (None: nothing),
    and the data phase to record now (None: nothing to write) once the last came and the
    longest grew."""
    after = replace(late, waiting=0 if report.for_group else late.waiting - 1,
                    longest=max(late.longest, report.data_seconds))
    if after.waiting > 0:
        return after, None
    return None, (after.longest if after.longest > after.recorded else None)


def _all_answered(resize: InflightResize) -> bool:
    # counted first: asked at each turn of the loop, it looks at each participant only once
    # as many answered or died as there are participants
    if resize.whole:
        return True
    return len(resize.reports) + len(resize.dead) >= len(resize.participants) and \
        all(v in resize.reports or v in resize.dead for v in resize.participants)


def answer(before: Resized | None, now: Resized) -> Resized:
    """A process's answer to the resize in flight, given what it said before: a commit is
    final (two-phase: a process that committed cannot abort the same generation; an abort
    after it is a copy of the order refused, not the resize's outcome). A later commit
    replaces an earlier one (the early report of a long install wait has no figures)."""
    if before is not None and before.outcome == ProcessOutcome.COMMITTED and \
            now.outcome != ProcessOutcome.COMMITTED:
        return before
    return now


def late_to_join(unjoined: Mapping[int, tuple[int, float]], now: float,
                 join_timeout_s: float) -> list[int]:
    """Launched workers (vrank -> (generation, launched at)) that have not said Hello within
    the join timeout: they never join. ``unjoined`` is in launch order (the oldest first, as
    the loop keeps it): the scan ends at the first worker still within its time, so a turn
    with none late costs one look, not one a launched worker."""
    late = []
    for v, (_g, at) in unjoined.items():
        if now - at <= join_timeout_s:
            break
        late.append(v)
    return sorted(late)


def warming_up(resize: InflightResize | None) -> bool:
    """A grow whose joiners warm up while the old layout trains: not ordered, nobody paused."""
    return resize is not None and not resize.sent_at and bool(resize.joiners)


def late_to_be_ready(resize: InflightResize | None, unjoined: Collection[int], now: float,
                     join_timeout_s: float, order_after_joined: bool) -> list[int]:
    """Joiners of the grow in flight that said Hello but not Ready within the join timeout
    of their launch (its old layout not ordered yet): given up, the grow replanned."""
    if resize is None or resize.sent_at or not order_after_joined or \
            now - resize.started <= join_timeout_s:
        return []
    return sorted(resize.joiners - resize.ready - resize.dead - set(unjoined))


def overdue(resize: InflightResize | None, unjoined: Mapping[int, tuple[int, float]],
            now: float, join_timeout_s: float, order_after_joined: bool) -> list[Effect]:
    """The launched workers given up at ``now``: joiners of the grow in flight that said
    Hello but not Ready, then workers that never said Hello, each within the join timeout of
    its launch."""
    limit = f"{join_timeout_s:.0f} s of its launch (slurm-etc run --join-timeout)"
    effects: list[Effect] = []
    late = late_to_be_ready(resize, unjoined, now, join_timeout_s, order_after_joined)
    if late:
        effects.append(NeverReady({v: f"vrank {v} said hello but was not ready within "
                                      f"{limit}: its log says why" for v in late}))
    late = late_to_join(unjoined, now, join_timeout_s)
    if late:
        effects.append(NeverJoined(tuple(late), f"did not say hello within {limit}"))
    return effects


def supersede(resize: InflightResize | None, now: float) -> list[Effect]:
    """A preemption notice or a loss came: a grow whose joiners still warm up (its old
    layout not ordered, nobody paused) is given up at once, its end recorded first; the
    next decision plans from what the job holds now (a shrink needs no joiner)."""
    if resize is None or not warming_up(resize):
        return []
    why = "superseded by a preemption notice or a loss during its joiners' warm-up"
    return [RecordFinish(resize.migration_id, ResizeOutcome.ABORTED, now - resize.started,
                         error=why), Supersede(why)]


def rebuilt(resize: InflightResize) -> tuple[tuple[int, int] | None, str | None]:
    """The steps a committed rebuild lost and where the lost state came from, as the
    workers reported them (every rank of the new layout reports the same)."""
    if not resize.rebuild:
        return None, None
    committed = [r for r in resize.reports.values() if r.outcome == ProcessOutcome.COMMITTED]
    spans = {r.lost_steps for r in committed if r.lost_steps is not None}
    sources = {r.rebuilt_from for r in committed if r.rebuilt_from}
    if len(spans) > 1 or len(sources) > 1:
        logger.error("workers disagree on the rebuild: lost steps %s, from %s", sorted(spans),
                     sorted(sources))
    span = max(spans, key=lambda s: (s[1] - s[0], s)) if spans else None
    return ((int(span[0]), int(span[1])) if span else None,
            min(sources) if sources else None)


@dataclass(frozen=True)
class Holdings:
    """What the job holds between resizes: the committed layout and its generation, each
    vrank's device, the devices held (device -> allocation), those under notice or lost
    (``notices``: device -> (deadline or when lost, "preemption" or "failure"); see
    devices.py), those lost, the vranks whose process left at a commit and may still be
    exiting (``leaving``), and the last step and loss reported."""

    layout: Layout | None
    generation: int
    vranks: Mapping[int, Device]
    held: Mapping[Device, str]
    notices: Mapping[Device, tuple[float, str]]
    lost: frozenset[Device]
    leaving: frozenset[int]
    step: int
    loss: float | None

    @classmethod
    def nothing(cls) -> Holdings:
        """What a job holds before its first grant."""
        return cls(None, 0, {}, {}, {}, frozenset(), frozenset(), 0, None)


# -- effects: what the loop performs, in order ---------------------------------------------

@dataclass(frozen=True)
class RecordFinish:
    """Record how migration ``migration_id`` ended."""

    migration_id: int
    outcome: ResizeOutcome
    measured_seconds: float
    pause_seconds: float | None = None
    data_seconds: float | None = None
    lost_steps: tuple[int, int] | None = None
    rebuilt_from: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class CloseGeneration:
    """Record the end of generation ``generation``."""

    generation: int
    reason: str
    last_step: int
    last_loss: float | None


@dataclass(frozen=True)
class OpenGeneration:
    """Record the start of generation ``generation`` (layout on vranks, from a step)."""

    generation: int
    layout: Layout
    vranks: Mapping[int, Device]
    first_step: int


@dataclass(frozen=True)
class ReleaseLater:
    """These devices leave the job now that no layout needs them: with those under notice
    (never the layout's nor the anchor's: ``devices.to_release``), the record marks them
    released, then the backend gives them back."""

    devices: frozenset[Device]


@dataclass(frozen=True)
class StopIdle:
    """Stop the joiners still alive after their resize aborted, then end the job."""

    why: str


@dataclass(frozen=True)
class NeverJoined:
    """Stop these launched workers, silent past the join timeout, each handled as one that
    exited before joining (``what``: how the line saying so ends)."""

    vranks: tuple[int, ...]
    what: str


@dataclass(frozen=True)
class NeverReady:
    """Stop these joiners of the grow in flight (a Hello, no Ready, past the join timeout):
    each dead on a failed device, the grow replanned without them (``whys``: vrank -> the
    line saying why)."""

    whys: Mapping[int, str]


@dataclass(frozen=True)
class Supersede:
    """Give up the grow in flight (nobody paused): its joiners stay idle until the next
    decision stops them, and that decision plans from what the job holds now."""

    why: str


Effect = (RecordFinish | CloseGeneration | OpenGeneration | ReleaseLater | StopIdle
          | NeverJoined | NeverReady | Supersede)


def commit(held: Holdings, resize: InflightResize, done: Commit, wall: float
           ) -> tuple[Holdings, list[Effect]]:
    """What a committed resize changes: the new layout and generation, its vranks' devices,
    the old ranks that leave, the lost devices it no longer holds forgotten (a later grant
    of one is a new device), the step rolled back for a rebuild; and the effects, record
    first: the migration's end, the old generation closed, the new one opened, then the
    devices it released."""
    new = resize.order.new.layout()
    step, loss = held.step, held.loss
    if done.switch_step is not None and done.switch_step != step:
        # the new layout's first steps, heard before the commit, are not the old one's (soak
        # seed 102: recorded the switch 2 steps late, the replay diverged from there)
        step, loss = done.switch_step, None
    last_old, last_loss = step, loss  # where the old generation ended
    if done.lost_steps is not None:  # rolled back: the steps after the copy train again
        last_old, last_loss = held.step, held.loss
        step, loss = done.lost_steps[0] - 1, None
    vranks = {v: resize.vranks[v] for v in new.devices}
    # a device that failed after the commit is in the new layout: the next resize names it
    gone = held.lost - set(vranks.values())
    after = Holdings(
        layout=new, generation=resize.order.generation, vranks=vranks,
        held={d: a for d, a in held.held.items() if d not in gone},
        notices={d: n for d, n in held.notices.items() if d not in gone},
        lost=held.lost - gone,
        leaving=held.leaving | frozenset(set(resize.order.old.devices) - set(new.devices)
                                         - resize.dead),
        step=step, loss=loss)
    effects: list[Effect] = [
        RecordFinish(resize.migration_id, ResizeOutcome.COMMITTED, wall, done.pause_s,
                     done.data_s, done.lost_steps, done.rebuilt_from),
        CloseGeneration(held.generation, resize.order.reason[:200] or "resized", last_old,
                        last_loss),
        OpenGeneration(after.generation, new, vranks, step),
        ReleaseLater(frozenset(resize.release)),
    ]
    return after, effects


def abort(resize: InflightResize, aborted: Abort, wall: float) -> list[Effect]:
    """The effects of an aborted resize: its end recorded, and where nobody died (it would
    abort the same way again) the idle joiners stopped and the job ended."""
    effects: list[Effect] = [RecordFinish(resize.migration_id, ResizeOutcome.ABORTED, wall,
                                          error=aborted.why[:500])]
    if not aborted.retry:
        effects.append(StopIdle("resize aborted"))
    return effects


# -- the order of a resize -----------------------------------------------------------------

@dataclass(frozen=True)
class OrderedResize:
    """A resize to order: the order, its plan and the bookkeeping around it.

    Attributes:
        order: what the workers get.
        plan: the migration the order's digest names.
        rebuild: lost state no replica holds is rebuilt (peer copies or a checkpoint).
        vranks: every vrank's device, the old layout's and the pool's.
        joiners: vranks that start a process for it.
        participants: every live vrank of old and new.
        grace_left: seconds of the notice's grace left (None: no deadline).
        aside_needs: the grace preparing beside training needs.
    """

    order: Resize
    plan: MigrationPlan
    rebuild: bool
    vranks: Mapping[int, Device]
    joiners: frozenset[int]
    participants: frozenset[int]
    grace_left: float | None
    aside_needs: float


def aside_needs(longest_aside_s: float | None, estimate_s: float, first_s: float,
                step_s: float | None) -> float:
    """The grace a resize needs left to be prepared beside training: ``first_s`` until one
    was timed, then ASIDE_MARGIN x the longest timed plus the plan's estimate; and at least
    ASIDE_MARGIN x ASIDE_STEPS training steps of ``step_s`` (the last step's time; None: none
    trained yet) plus the estimate (its stages wait for step boundaries)."""
    timed = first_s if longest_aside_s is None else ASIDE_MARGIN * longest_aside_s + estimate_s
    if step_s is None:
        return timed
    return max(timed, ASIDE_MARGIN * ASIDE_STEPS * step_s + estimate_s)


def order_resize(held: Holdings, *, job_id: str, generation: int, config: ParallelConfig,
                 pool: Mapping[int, Device], deadline: float | None, reason: str, now: float,
                 model: ModelDesc, topology: Topology, gpus_per_node: int,
                 can_rebuild: bool, prepare_while_training: bool,
                 longest_aside_s: float | None, first_aside_grace_s: float,
                 step_s: float | None = None) -> OrderedResize:
    """The resize from the committed layout to ``config`` on ``pool`` (the allocator's
    vrank -> device) as generation ``generation``: the vranks reserved, the plan (with the
    rebuild fallback for devices lost), joiners, participants, and whether the old layout
    prepares beside training (``now`` and ``deadline`` on the clock of the notices;
    ``step_s``: the last training step's time, None where none is known).
    Raises JobStopped where the lost state can be neither moved nor rebuilt."""
    old = held.layout
    if old is None:
        raise ValueError("a resize needs a committed layout")
    lost = sorted(v for v in old.devices if held.vranks[v] in held.lost)
    pool_map = reserve_vranks(pool, {v: held.vranks[v] for v in old.devices}, gpus_per_node)
    vranks = {**{v: held.vranks[v] for v in old.devices}, **pool_map}
    plan, rebuild = plan_resize(model, old, config, sorted(pool_map), topology, lost,
                                format_devices(held.vranks[v] for v in lost), can_rebuild)
    new = plan.new
    left = None if deadline is None else deadline - now
    need = aside_needs(longest_aside_s, plan.est_seconds, first_aside_grace_s, step_s)
    aside = prepare_while_training and (left is None or left >= need)
    order = Resize(job_id, generation, LayoutSpec.of(old), LayoutSpec.of(new),
                   plan_digest(plan), pool_runs=pack_runs(sorted(pool_map)),
                   gpus_per_node=gpus_per_node, deadline=deadline, lost=tuple(lost),
                   reason=reason[:200], prepare_while_training=aside)
    return OrderedResize(order, plan, rebuild, vranks,
                         frozenset(set(new.devices) - set(old.devices)),
                         frozenset((set(old.devices) | set(new.devices)) - set(lost)),
                         left, need)


def longest_aside(longest_s: float | None, resize: InflightResize, now: float,
                  pause_s: float) -> float | None:
    """The longest preparation beside training timed so far (None: none yet), with that of
    ``resize``, committed at ``now`` after a pause of ``pause_s``: from its order to its
    commit, less the pause (what ``aside_needs`` weighs a notice's grace against)."""
    if not (resize.order.prepare_while_training and resize.sent_at):
        return longest_s
    return max(longest_s or 0.0, now - resize.sent_at - pause_s)


def reserve_vranks(pool: Mapping[int, Device], layout: Mapping[int, Device],
                   gpus_per_node: int) -> dict[int, Device]:
    """``pool`` renumbered so that no vrank of the current layout names another device.

    A vrank is the planner's identity of the device that holds a shard. The allocator may
    give a leaving device's vrank to a new device (a grant and a notice in one decision);
    until the migration is done the old device still holds that vrank's state, so the
    new device's whole node slot moves to fresh vranks past every slot in use (node slots
    stay whole: vrank // gpus_per_node is the node)."""
    clash = {v // gpus_per_node for v, d in pool.items() if v in layout and layout[v] != d}
    if not clash:
        return dict(pool)
    top = max([*pool, *layout]) // gpus_per_node + 1
    fresh = {slot: top + i for i, slot in enumerate(sorted(clash))}
    return {(fresh[v // gpus_per_node] * gpus_per_node + v % gpus_per_node
             if v // gpus_per_node in fresh else v): d for v, d in pool.items()}
