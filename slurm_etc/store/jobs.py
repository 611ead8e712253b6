"""The job record: what the coordinator writes before it acts, what ``status`` reads.

Every write is one short transaction; a store opened with :func:`open_job_store` publishes
a snapshot of the job's node-local database after each commit. Actions a restarted
coordinator may repeat are idempotent: creating the same job, recording an event with the
same ``key``, opening the same generation with the same layout, closing a closed generation,
starting the same unfinished migration, finishing a migration with the same outcome.

Times are aware UTC datetimes; every writer takes ``at`` (default: now) so tests and
replays pass time in.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import (
    Any,
    Iterable,
    Mapping,
    Protocol,
    Sequence,
    cast,
)

from sqlalchemy import Table, func, insert, select, update
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session

from ..lifecycle import (
    ACTIVE_JOB_STATES,
    ENDED_JOB_STATES,
    AllocationRole,
    AllocationState,
    Backend,
    DeviceState,
    JobState,
    ResizeOutcome,
    job_transition_error,
)
from . import guard
from .db import Store, StoreError, guarded, open_store, open_store_readonly, sqlite_path
from .location import (
    LocationError,
    check_job_id,
    check_writable_location,
    default_local_db,
    default_state_dir,
    open_private_dir,
    private_dir,
    snapshot_path,
)
from .models import (
    AllocationRow,
    DeviceRow,
    EventRow,
    GenerationRow,
    JobRow,
    MigrationRow,
    VrankRow,
)
from .snapshot import Publisher, SnapshotError, ensure_state_dir, restore_snapshot

log = logging.getLogger(__name__)

JOB_STATES = tuple(JobState)
ENDED_STATES = ENDED_JOB_STATES
BACKENDS = tuple(Backend)
ALLOCATION_ROLES = tuple(AllocationRole)
ALLOCATION_STATES = tuple(AllocationState)
DEVICE_STATES = tuple(DeviceState)
MIGRATION_OUTCOMES = tuple(ResizeOutcome)
# Where the state of devices lost without grace came from when no replica held it.
REBUILT_FROM = ("peer-copies", "checkpoint")
ACTIVE_STATES = ACTIVE_JOB_STATES
# A live coordinator writes its job's record at least this often (``heartbeat``), even when
# nothing happens; a job in an active state whose record is older than LOST_AFTER_S is shown
# ``lost`` (its coordinator was killed, its node died, or it hangs).
HEARTBEAT_S = 30.0
LOST_AFTER_S = 4 * HEARTBEAT_S
# Event kinds the coordinator uses; others are stored as given.
EVENT_KINDS = ("grant", "preempt-notice", "loss", "release", "resize-request", "stop")
# the workers' choice of the peer-copy interval ("auto"): its figures and the line saying it
PEER_COPIES_EVENT = "peer-copies"

_ALLOCATION_TIMES: dict[str, str] = {
    AllocationState.GRANTED: "granted_at", AllocationState.LOST: "lost_at",
    AllocationState.RELEASED: "released_at"}
_DEVICE_ON_ALLOCATION: dict[str, str] = {AllocationState.LOST: DeviceState.LOST,
                                         AllocationState.RELEASED: DeviceState.RELEASED}
_ON_THE_JOB = (DeviceState.HELD, DeviceState.LEAVING)


class RecordError(StoreError):
    """A call the job record refuses: unknown job, invalid value, or a repeat that
    contradicts what is recorded (one line; nothing was written)."""


_guarded = guarded("the job record")


class DeviceLike(Protocol):
    """A device as the allocator names it (``alloc.Device``): node and local index."""

    @property
    def node(self) -> str: ...

    @property
    def local(self) -> int: ...


# ---------------------------------------------------------------- read-side values


@dataclass(frozen=True)
class JobSummary:
    """One job in a listing: identity, state, the layout training now."""

    job_id: str
    name: str
    owner_uid: int
    owner_name: str
    state: str
    reason: str | None
    backend: str
    model: str | None
    partition: str | None
    account: str | None
    coordinator: str | None
    generation: int | None
    layout: str | None
    world_size: int
    nodes: tuple[str, ...]
    created_at: datetime
    updated_at: datetime
    ended_at: datetime | None
    pending_events: int
    migrations: int

    def last_update_age(self, now: datetime) -> float:
        """Seconds since the record was last written."""
        return max(0.0, (now - self.updated_at).total_seconds())

    def shown_state(self, now: datetime) -> str:
        """The recorded state, or ``lost`` for an active job whose coordinator stopped
        writing (no heartbeat for :data:`LOST_AFTER_S`)."""
        if self.state in ACTIVE_STATES and self.last_update_age(now) > LOST_AFTER_S:
            return "lost"
        return self.state

    def to_json(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "name": self.name, "owner": self.owner_name,
                "owner_uid": self.owner_uid, "state": self.state, "reason": self.reason,
                "backend": self.backend, "model": self.model, "partition": self.partition,
                "account": self.account, "coordinator": self.coordinator,
                "generation": self.generation, "layout": self.layout,
                "world_size": self.world_size, "nodes": list(self.nodes),
                "created": _iso(self.created_at), "updated": _iso(self.updated_at),
                "ended": _iso(self.ended_at), "pending_events": self.pending_events}


@dataclass(frozen=True)
class AllocationInfo:
    backend_id: str
    role: str
    partition: str | None
    state: str
    nodes: tuple[str, ...]
    requested_at: datetime
    granted_at: datetime | None
    lost_at: datetime | None
    released_at: datetime | None

    def to_json(self) -> dict[str, Any]:
        return {"backend_id": self.backend_id, "role": self.role, "partition": self.partition,
                "state": self.state, "nodes": list(self.nodes),
                "requested": _iso(self.requested_at), "granted": _iso(self.granted_at),
                "lost": _iso(self.lost_at), "released": _iso(self.released_at)}


@dataclass(frozen=True)
class DeviceInfo:
    node: str
    local_index: int
    state: str
    allocation: str | None

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "local_index": self.local_index, "state": self.state,
                "allocation": self.allocation}


@dataclass(frozen=True)
class VrankInfo:
    """A vrank of a generation; ``rank`` is the layout rank on it (None: idle)."""

    generation: int
    vrank: int
    rank: int | None
    node: str
    local_index: int

    def to_json(self) -> dict[str, Any]:
        return {"generation": self.generation, "vrank": self.vrank, "rank": self.rank,
                "node": self.node, "local_index": self.local_index}


@dataclass(frozen=True)
class GenerationInfo:
    number: int
    layout: str
    world_size: int
    started_at: datetime
    ended_at: datetime | None
    steps: int
    first_step: int | None
    last_step: int | None
    last_loss: float | None
    end_reason: str | None

    def duration_seconds(self, now: datetime) -> float:
        """Seconds trained under this layout (until ``now`` while it is open)."""
        return max(0.0, ((self.ended_at or now) - self.started_at).total_seconds())

    def to_json(self, now: datetime) -> dict[str, Any]:
        return {"number": self.number, "layout": self.layout, "world_size": self.world_size,
                "started": _iso(self.started_at), "ended": _iso(self.ended_at),
                "duration_seconds": round(self.duration_seconds(now), 3),
                "steps": self.steps, "first_step": self.first_step,
                "last_step": self.last_step, "last_loss": self.last_loss,
                "end_reason": self.end_reason}


@dataclass(frozen=True)
class EventInfo:
    id: int
    kind: str
    source: str
    payload: Any
    deadline: datetime | None
    received_at: datetime
    handled_at: datetime | None
    outcome: str | None
    key: str | None

    @property
    def pending(self) -> bool:
        return self.handled_at is None

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "source": self.source,
                "payload": self.payload, "deadline": _iso(self.deadline),
                "received": _iso(self.received_at), "handled": _iso(self.handled_at),
                "pending": self.pending, "outcome": self.outcome, "key": self.key}


@dataclass(frozen=True)
class MigrationInfo:
    id: int
    from_generation: int
    to_generation: int
    plan_digest: str
    moved_bytes: int
    kept_bytes: int
    lower_bound_bytes: int
    messages: int
    rounds: int
    estimated_seconds: float | None
    measured_seconds: float | None
    pause_seconds: float | None
    outcome: str | None
    error: str | None
    started_at: datetime
    ended_at: datetime | None
    event_id: int | None
    lost_steps: tuple[int, int] | None = None
    rebuilt_from: str | None = None
    data_seconds: float | None = None
    preparation_seconds: float | None = None
    paused_at: datetime | None = None
    resumed_at: datetime | None = None
    pause_processes: int | None = None
    stall_seconds: float | None = None
    interrupted_seconds: float | None = None

    @property
    def pause_measured(self) -> bool:
        """Whether ``pause_seconds`` is the gap measured at the step boundaries (else the
        workers' own timing of the resize, until every process reported its gap)."""
        return self.pause_processes is not None

    @property
    def ratio_to_lower_bound(self) -> float | None:
        """Bytes moved over the lower bound (1.0 is optimal); None when the bound is 0 but
        bytes moved."""
        if self.lower_bound_bytes == 0:
            return 1.0 if self.moved_bytes == 0 else None
        return self.moved_bytes / self.lower_bound_bytes

    def to_json(self) -> dict[str, Any]:
        ratio = self.ratio_to_lower_bound
        return {"id": self.id, "from_generation": self.from_generation,
                "to_generation": self.to_generation, "plan_digest": self.plan_digest,
                "moved_bytes": self.moved_bytes, "kept_bytes": self.kept_bytes,
                "lower_bound_bytes": self.lower_bound_bytes,
                "ratio_to_lower_bound": None if ratio is None else round(ratio, 4),
                "messages": self.messages, "rounds": self.rounds,
                "estimated_seconds": self.estimated_seconds,
                "measured_seconds": self.measured_seconds,
                "pause_seconds": self.pause_seconds, "outcome": self.outcome,
                "error": self.error, "started": _iso(self.started_at),
                "ended": _iso(self.ended_at), "event_id": self.event_id,
                "lost_steps": None if self.lost_steps is None else list(self.lost_steps),
                "rebuilt_from": self.rebuilt_from, "data_seconds": self.data_seconds,
                "preparation_seconds": self.preparation_seconds,
                "paused_at": _iso(self.paused_at), "resumed_at": _iso(self.resumed_at),
                "pause_processes": self.pause_processes,
                "pause_measured": self.pause_measured, "stall_seconds": self.stall_seconds,
                "interrupted_seconds": self.interrupted_seconds}


@dataclass(frozen=True)
class JobDetail:
    """Everything recorded about one job; ``vranks`` are the current generation's."""

    job: JobSummary
    allocations: tuple[AllocationInfo, ...] = ()
    devices: tuple[DeviceInfo, ...] = ()
    vranks: tuple[VrankInfo, ...] = ()
    generations: tuple[GenerationInfo, ...] = ()
    migrations: tuple[MigrationInfo, ...] = ()
    events: tuple[EventInfo, ...] = field(default=())

    @property
    def pending_events(self) -> tuple[EventInfo, ...]:
        return tuple(e for e in self.events if e.pending)

    @property
    def peer_copies(self) -> dict[str, Any] | None:
        """The workers' newest choice of the peer-copy interval (``--peer-copy-every auto``):
        ``every``, ``checkpoint_every``, the figures and the ``line``; None: not chosen (yet,
        or an interval was given)."""
        chosen = [e for e in self.events if e.kind == PEER_COPIES_EVENT
                  and isinstance(e.payload, dict)]
        return chosen[-1].payload if chosen else None

    def to_json(self, now: datetime | None = None) -> dict[str, Any]:
        """The job as ``slurm-etc status --json`` prints it."""
        now = now or _now()
        return {**self.job.to_json(), "state": self.job.shown_state(now),
                "recorded_state": self.job.state,
                "last_update_age_seconds": round(self.job.last_update_age(now), 1),
                "allocations": [a.to_json() for a in self.allocations],
                "devices": [d.to_json() for d in self.devices],
                "vranks": [v.to_json() for v in self.vranks],
                "generations": [g.to_json(now) for g in self.generations],
                "migrations": [m.to_json() for m in self.migrations],
                "peer_copies": self.peer_copies,
                "events": [e.to_json() for e in self.events]}


# ---------------------------------------------------------------- opening


def open_job_store(job_id: str, *, db: str | os.PathLike[str] | None = None,
                   state_dir: str | os.PathLike[str] | None = None,
                   publish: bool = True) -> Store:
    """The coordinator's store for one job.

    Default: a SQLite file on node-local disk (``location.default_local_db``, WAL mode,
    0600), restored from the job's snapshot in the state directory when the local file is
    missing (a coordinator restarted on another node), published to
    ``<state dir>/<uid>/<job>.db`` after every committed change (by a background thread that
    coalesces quick changes; ``store.flush()`` waits for it, ``store.close()`` finishes it).

    Only the caller's own snapshot is restored (owner from the descriptor read, in a
    directory only the caller can write, our schema, the job recorded as the caller's):
    anything else is left alone with one warning and the job starts a fresh record, so a
    file planted by another user neither speaks for the job nor stops it. Likewise a
    ``<state dir>/<uid>`` that is not the caller's alone is not published to (warned once;
    the record itself is on node-local disk).

    Args:
        job_id: the job (letters, digits, ``._-``).
        db: a SQLite path (node-local; refused on a network filesystem) or a server URL
            (``mysql+pymysql://...``, ``postgresql://...``: nothing is published).
        state_dir: where snapshots go; default ``location.default_state_dir()``.
        publish: publish snapshots (SQLite only).

    Raises:
        StoreError: an invalid job id, a refused location, a database that is not ours.
    """
    try:
        check_job_id(job_id)
    except LocationError as exc:
        raise RecordError(str(exc)) from None
    target: str | os.PathLike[str] = db if db is not None else default_local_db(job_id)
    local = sqlite_path(target)
    states = Path(state_dir).expanduser() if state_dir is not None else default_state_dir()
    snapshot = snapshot_path(states, job_id)
    if local is not None and not local.exists():
        try:
            check_writable_location(local)  # before writing anything there
            private_dir(local.parent)
        except LocationError as exc:
            raise StoreError(str(exc)) from None
        _restore_own(snapshot, local, job_id)
    store = open_store(target, wal=local is not None, private=local is not None,
                       refuse_network_fs=local is not None)
    if local is not None and publish:
        try:
            ensure_state_dir(states)
        except SnapshotError as exc:
            store.close()
            raise StoreError(str(exc)) from None
        try:
            os.close(open_private_dir(snapshot.parent))
        except LocationError as exc:
            log.warning("not publishing job %s's record to the state directory: %s "
                        "(`slurm-etc status --db %s` reads the record itself)", job_id, exc,
                        local)
            return store
        publisher = Publisher(local, snapshot)
        store.after_commit.append(publisher)
        store.on_flush.append(publisher.flush)
        store.on_close.append(publisher.close)
    return store


def _restore_own(snapshot: Path, local: Path, job_id: str) -> None:
    """Restore ``local`` from the caller's own ``snapshot`` if there is one and it checks
    out; otherwise leave no file (a fresh record) and say why once."""
    try:
        if not restore_snapshot(snapshot, local):
            return
    except SnapshotError as exc:
        log.warning("%s; job %s starts a fresh record", exc, job_id)
        return
    problem = None
    try:
        reader = open_store_readonly(local, limits=guard.ReadLimits(), name=str(snapshot))
        try:
            found = [j.owner_uid for j in list_jobs(reader)]
        finally:
            reader.close()
        strangers = [uid for uid in found if uid != os.getuid()]
        if strangers:
            problem = f"it records a job of uid {strangers[0]}, not yours (uid {os.getuid()})"
    except StoreError as exc:
        problem = str(exc)
    if problem:
        local.unlink(missing_ok=True)
        log.warning("not restoring %s: %s; job %s starts a fresh record", snapshot, problem,
                    job_id)


# ---------------------------------------------------------------- writes


@_guarded
def create_job(store: Store, job_id: str, *, name: str, owner_uid: int, owner_name: str,
               backend: str, model: str | None = None, partition: str | None = None,
               account: str | None = None, coordinator: str | None = None,
               at: datetime | None = None) -> None:
    """Record a new job (state ``starting``). Repeating it for the same owner and backend
    is a no-op, except that a new coordinator address replaces the old one.

    Raises:
        RecordError: invalid values, or the job exists with another owner or backend.
    """
    try:
        check_job_id(job_id)
    except LocationError as exc:
        raise RecordError(str(exc)) from None
    _one_of("backend", backend, BACKENDS)
    _text("name", name, 255, empty=True)
    _text("owner_name", owner_name, 64)
    _text("coordinator", coordinator, 255)
    if not isinstance(owner_uid, int) or owner_uid < 0:
        raise RecordError(f"owner_uid must be a non-negative integer, got {owner_uid!r}")
    at = _at(at)
    with store.transaction(write=True) as s:
        row = s.get(JobRow, job_id)
        if row is not None:
            if (row.owner_uid, row.backend) != (owner_uid, backend):
                raise RecordError(f"job {job_id} exists already, owned by uid {row.owner_uid} "
                                  f"on the {row.backend} backend; nothing was written")
            if coordinator and row.coordinator != coordinator:
                row.coordinator = coordinator
                row.updated_at = at
            return
        s.add(JobRow(job_id=job_id, name=name, owner_uid=owner_uid, owner_name=owner_name,
                     state=JobState.STARTING, backend=backend, model=model,
                     partition_name=partition,
                     account=account, coordinator=coordinator, created_at=at, updated_at=at))


@_guarded
def set_job_state(store: Store, job_id: str, state: str, *, reason: str | None = None,
                  at: datetime | None = None) -> None:
    """Record the job's observed state (``JOB_STATES``) and why; an ended state (finished,
    failed, cancelled) sets the end time once. Repeating it is a no-op; a move that
    :data:`slurm_etc.lifecycle.JOB_TRANSITIONS` does not allow is refused (RecordError)."""
    _one_of("state", state, JOB_STATES)
    _text("reason", reason, 255)
    at = _at(at)
    with store.transaction(write=True) as s:
        row = _job(s, job_id)
        if row.state == state and row.reason == reason:
            return
        refused = job_transition_error(job_id, row.state, state)
        if refused:
            raise RecordError(f"{refused}; nothing was written")
        row.state, row.reason, row.updated_at = state, reason, at
        if state in ENDED_STATES and row.ended_at is None:
            row.ended_at = at
        elif state not in ENDED_STATES:
            row.ended_at = None  # taken up again by a new coordinator


def heartbeat(store: Store, job_id: str, *, every_s: float = HEARTBEAT_S,
              at: datetime | None = None) -> bool:
    """Mark the job's record as written now, at most once every ``every_s`` seconds (the
    loop may call it on every turn): how ``status`` tells a live coordinator from a lost
    one. A failed write is logged and reported, never raised (the next beat tries again).

    Returns:
        Whether a beat was written.
    """
    now = time.monotonic()
    if store.beat_at is not None and now - store.beat_at < every_s:
        return False
    store.beat_at = now
    try:
        with store.transaction(write=True) as s:
            _touch(s, job_id, _at(at))
    except (SQLAlchemyError, StoreError) as exc:
        log.warning("job %s: heartbeat not recorded (%s); tried again in %.0f s", job_id,
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__, every_s)
        return False
    return True


@_guarded
def set_coordinator(store: Store, job_id: str, address: str | None,
                    at: datetime | None = None) -> None:
    """Where the live coordinator answers (``host:port``); None once it is gone."""
    _text("coordinator", address, 255)
    with store.transaction(write=True) as s:
        row = _job(s, job_id)
        if row.coordinator != address:
            row.coordinator, row.updated_at = address, _at(at)


@_guarded
def record_event(store: Store, job_id: str, kind: str, *, source: str,
                 payload: Mapping[str, Any] | None = None, deadline: datetime | None = None,
                 key: str | None = None, at: datetime | None = None) -> int:
    """Record an event before acting on it; returns its id.

    Args:
        kind: ``grant``, ``preempt-notice``, ``loss``, ... (``EVENT_KINDS``; free text).
        source: who told us (``slurm:signal``, ``slurm:squeue``, ``local``, ...).
        payload: JSON-serialisable details (allocation id, nodes, signal, ...).
        deadline: when the devices concerned are taken away (a preemption's grace).
        key: a client-chosen unique key (e.g. ``preempt:1234:USR2``): recording the same
            key again returns the first event's id and writes nothing.
    """
    _text("kind", kind, 32)
    _text("source", source, 64)
    _text("key", key, 128)
    try:
        text = None if payload is None else json.dumps(payload, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise RecordError(f"event payload is not JSON-serialisable: {exc}") from None
    at = _at(at)
    if key is not None:
        found = _event_by_key(store, job_id, key)
        if found is not None:
            return found
    try:
        with store.transaction(write=True) as s:
            _touch(s, job_id, at)
            row = EventRow(job_id=job_id, dedup_key=key, kind=kind, source=source,
                           payload=text, deadline=_at(deadline) if deadline else None,
                           received_at=at)
            s.add(row)
            s.flush()
            return row.id
    except IntegrityError:
        if key is not None:
            found = _event_by_key(store, job_id, key)
            if found is not None:
                return found
        raise


@dataclass(frozen=True)
class Observed:
    """One backend event for :func:`record_observed`: its event row and the change to its
    allocation.

    Attributes:
        kind, payload, deadline: as for :func:`record_event`.
        key: the event's identity (``grant:<allocation>``, ...): a backend that reports it
            again (a restarted coordinator re-reads Slurm) records nothing new.
        allocation: the allocation concerned; None: no allocation change.
        state: the allocation's new state; the allocation is created (with ``role``) when
            it is new.
        nodes: the allocation's nodes, when known.
    """

    kind: str
    key: str
    payload: Mapping[str, Any] = field(default_factory=dict)
    deadline: datetime | None = None
    allocation: str | None = None
    state: str | None = None
    role: str = "member"
    nodes: tuple[str, ...] | None = None


@_guarded
def record_observed(store: Store, job_id: str, observed: Sequence[Observed], *,
                    source: str = "backend", at: datetime | None = None) -> list[int]:
    """Record one poll's events with their allocation changes in ONE transaction (a burst
    of a thousand node events is one commit, not two thousand); returns the event ids in
    order. An event whose key is recorded already keeps its row (its id is returned, its
    allocation change is not applied again)."""
    _text("source", source, 64)
    for o in observed:
        _text("kind", o.kind, 32)
        _text("key", o.key, 128)
        if o.state is not None:
            _one_of("allocation state", o.state, ALLOCATION_STATES)
        _one_of("role", o.role, ALLOCATION_ROLES)
    if not observed:
        return []
    try:
        texts = [json.dumps(o.payload, sort_keys=True) for o in observed]
    except (TypeError, ValueError) as exc:
        raise RecordError(f"event payload is not JSON-serialisable: {exc}") from None
    at = _at(at)
    with store.transaction(write=True) as s:
        _touch(s, job_id, at)
        seen: dict[str, int] = {}
        for chunk in _chunks(sorted({o.key for o in observed})):
            for key, eid in s.execute(select(EventRow.dedup_key, EventRow.id).where(
                    EventRow.job_id == job_id, EventRow.dedup_key.in_(chunk))):
                seen[str(key)] = int(eid)
        fresh: dict[str, tuple[Observed, str]] = {}  # a key twice in one poll: recorded once
        for o, text in zip(observed, texts):
            if o.key not in seen:
                fresh.setdefault(o.key, (o, text))
        _apply_allocation_changes(s, job_id, [o for o, _ in fresh.values()], at)
        if fresh:  # one multi-row INSERT ... RETURNING, not an ORM object per event
            for key, eid in s.execute(insert(_table(EventRow)).returning(
                    EventRow.dedup_key, EventRow.id), [
                    {"job_id": job_id, "dedup_key": o.key, "kind": o.kind, "source": source,
                     "payload": text, "deadline": _at(o.deadline) if o.deadline else None,
                     "received_at": at, "handled_at": None, "outcome": None}
                    for o, text in fresh.values()]):
                seen[str(key)] = int(eid)
        return [seen[o.key] for o in observed]


def _apply_allocation_changes(s: Session, job_id: str, observed: Sequence[Observed],
                              at: datetime) -> None:
    """The allocation changes of one poll's new events, applied in order as
    :func:`_update_allocation` would, written with a few set-based statements (new
    allocations in one INSERT, changed ones in one executemany, their devices by state)."""
    names = sorted({o.allocation for o in observed if o.allocation is not None})
    if not names:
        return
    cols = ("id", "state", "nodes", "granted_at", "lost_at", "released_at")
    rows: dict[str, dict[str, Any]] = {}
    for chunk in _chunks(names):
        for r in s.execute(select(AllocationRow.backend_id, AllocationRow.id,
                                  AllocationRow.state, AllocationRow.nodes,
                                  AllocationRow.granted_at, AllocationRow.lost_at,
                                  AllocationRow.released_at).where(
                AllocationRow.job_id == job_id, AllocationRow.backend_id.in_(chunk))):
            rows[r[0]] = dict(zip(cols, r[1:]))
    new = {}
    for o in observed:
        if o.allocation is not None and o.allocation not in rows and o.allocation not in new:
            new[o.allocation] = {"job_id": job_id, "backend_id": o.allocation, "role": o.role,
                                 "partition_name": None, "state": AllocationState.REQUESTED,
                                 "nodes": _nodes(o.nodes or ()), "requested_at": at,
                                 "granted_at": None, "lost_at": None, "released_at": None}
    if new:
        for name, aid in s.execute(insert(_table(AllocationRow)).returning(
                AllocationRow.backend_id, AllocationRow.id), list(new.values())):
            rows[str(name)] = {"id": int(aid), "state": AllocationState.REQUESTED,
                               "nodes": new[name]["nodes"], "granted_at": None,
                               "lost_at": None, "released_at": None}
    changed: dict[str, dict[str, Any]] = {}
    devices: dict[int, str] = {}  # allocation id -> its devices' state (first change wins:
    for o in observed:            # later ones find no held device, as one at a time would)
        if o.allocation is None:
            continue
        row = rows[o.allocation]
        if o.nodes is not None:
            row["nodes"] = _nodes(o.nodes)
            changed[o.allocation] = row
        if o.state is None or o.state == row["state"]:
            continue
        row["state"] = o.state
        changed[o.allocation] = row
        column = _ALLOCATION_TIMES.get(o.state)
        if column and row[column] is None:
            row[column] = at
        device_state = _DEVICE_ON_ALLOCATION.get(o.state)
        if device_state:
            devices.setdefault(row["id"], device_state)
    if changed:
        s.execute(update(AllocationRow), list(changed.values()))
    for state in sorted(set(devices.values())):
        ids = sorted(a for a, d in devices.items() if d == state)
        for chunk in _chunks(ids):
            s.execute(update(DeviceRow).where(
                DeviceRow.allocation_id.in_(chunk), DeviceRow.state.in_(_ON_THE_JOB))
                .values(state=state, updated_at=at)
                .execution_options(synchronize_session=False))


@_guarded
def mark_events_handled(store: Store, event_ids: Sequence[int], outcome: str, *,
                        at: datetime | None = None) -> None:
    """:func:`mark_event_handled` for many events, in one transaction."""
    _text("outcome", outcome, 255)
    if not event_ids:
        return
    when = _at(at)
    with store.transaction(write=True) as s:
        job_ids: set[str] = set()
        for chunk in _chunks(sorted(set(event_ids))):
            pending = (EventRow.id.in_(chunk), EventRow.handled_at.is_(None))
            job_ids.update(s.scalars(select(EventRow.job_id).where(*pending).distinct()))
            s.execute(update(EventRow).where(*pending)
                      .values(handled_at=when, outcome=outcome)
                      .execution_options(synchronize_session=False))
        for job_id in sorted(job_ids):
            _touch(s, job_id, when)


@dataclass(frozen=True)
class OpenRequest:
    """A node request recorded and not answered (no grant, no failure) before a restart.

    Its fields come from the record, i.e. from the job's own past decisions, which a
    restarted coordinator should check again against the policy and the cluster before it
    sends the request again (the record is only as trustworthy as its file's owner).

    Attributes:
        key: the request's key (``grow-3``), as sent to the backend.
        nodes: how many nodes it asked for.
        reason: the decision's one-line reason, as recorded.
        recorded_at: when it was recorded.
    """

    key: str
    nodes: int
    reason: str
    recorded_at: datetime


@dataclass(frozen=True)
class ResumePoint:
    """What a restarted coordinator resumes with (:func:`recover`).

    Attributes:
        pending_events: events recorded and not handled (handled by its first decision).
        last_generation: the highest generation recorded or ordered; -1 for none.
        requests: node requests recorded (the next request key continues after them).
        aborted: migrations that were in flight, now closed as aborted.
        open_request: the newest request still unanswered, if any.
    """

    pending_events: tuple[int, ...]
    last_generation: int
    requests: int
    aborted: tuple[int, ...]
    open_request: OpenRequest | None = None


@_guarded
def recover(store: Store, job_id: str, *, reason: str = "coordinator restarted",
            at: datetime | None = None) -> ResumePoint:
    """At a coordinator's start: close every migration still in flight as aborted with
    ``reason`` (its workers died with the coordinator or are restarted: nothing was
    committed), once; and return what the loop resumes with. Repeating it changes nothing."""
    _text("reason", reason, 500)
    at = _at(at)
    with store.transaction(write=True) as s:
        _job(s, job_id)
        pending = tuple(s.scalars(select(EventRow.id).where(
            EventRow.job_id == job_id, EventRow.handled_at.is_(None)).order_by(EventRow.id)))
        aborted = []
        for m in s.scalars(select(MigrationRow).where(MigrationRow.job_id == job_id,
                                                      MigrationRow.outcome.is_(None))):
            m.outcome, m.error, m.ended_at = ResizeOutcome.ABORTED, reason, at
            aborted.append(m.id)
        if aborted:
            _touch(s, job_id, at)
        gens = s.scalar(select(func.max(GenerationRow.number)).where(
            GenerationRow.job_id == job_id))
        ordered = s.scalar(select(func.max(MigrationRow.to_generation)).where(
            MigrationRow.job_id == job_id))
        requests = s.scalar(select(func.count()).select_from(EventRow).where(
            EventRow.job_id == job_id, EventRow.kind == "request")) or 0
        last = max(-1 if gens is None else gens, -1 if ordered is None else ordered)
        return ResumePoint(pending, last, int(requests), tuple(aborted), _open_request(s, job_id))


def _open_request(s: Session, job_id: str) -> OpenRequest | None:
    """The newest ``request`` event that no grant, request failure or withdrawal answered."""
    rows = s.scalars(select(EventRow).where(
        EventRow.job_id == job_id,
        EventRow.kind.in_(("request", "grant", "request-failed", "request-withdrawn"))
    ).order_by(EventRow.id)).all()
    answered = set()
    for r in rows:
        payload = _event(r).payload
        if r.kind != "request" and isinstance(payload, dict) and payload.get("request"):
            answered.add(str(payload["request"]))
    asked = [r for r in rows if r.kind == "request" and r.dedup_key]
    if not asked:
        return None
    last = asked[-1]
    key = str(last.dedup_key).removeprefix("request:")
    payload = _event(last).payload
    if key in answered or not isinstance(payload, dict):
        return None
    nodes = payload.get("nodes")
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
        return None
    return OpenRequest(key, nodes, str(payload.get("summary", ""))[:200],
                       _at(last.received_at))


@_guarded
def mark_event_handled(store: Store, event_id: int, outcome: str, *,
                       at: datetime | None = None) -> None:
    """Mark an event handled with its outcome (``resized to generation 4``, ``ignored:
    ...``). An event already handled keeps its first outcome."""
    _text("outcome", outcome, 255)
    with store.transaction(write=True) as s:
        row = s.get(EventRow, event_id)
        if row is None:
            raise RecordError(f"no event {event_id}")
        if row.handled_at is None:
            when = _at(at)
            row.handled_at, row.outcome = when, outcome
            _touch(s, row.job_id, when)


@_guarded
def pending_events(store: Store, job_id: str) -> list[EventInfo]:
    """Events recorded but not handled, oldest first (what a restarted coordinator
    resumes with)."""
    with store.transaction() as s:
        rows = s.scalars(select(EventRow).where(EventRow.job_id == job_id,
                                                EventRow.handled_at.is_(None))
                         .order_by(EventRow.id)).all()
        return [_event(r) for r in rows]


@_guarded
def record_allocation(store: Store, job_id: str, backend_id: str, *, role: str = "member",
                      partition: str | None = None, state: str = AllocationState.REQUESTED,
                      nodes: Sequence[str] = (), at: datetime | None = None) -> int:
    """Record a backend allocation (a Slurm job id); returns its id. Recording the same
    backend id again updates its state and nodes (as :func:`update_allocation`)."""
    _text("backend_id", backend_id, 64)
    _one_of("role", role, ALLOCATION_ROLES)
    _one_of("allocation state", state, ALLOCATION_STATES)
    at = _at(at)
    with store.transaction(write=True) as s:
        _touch(s, job_id, at)
        row = _find_allocation(s, job_id, backend_id)
        if row is None:
            row = AllocationRow(job_id=job_id, backend_id=backend_id, role=role,
                                partition_name=partition, state=AllocationState.REQUESTED,
                                nodes=_nodes(nodes), requested_at=at)
            s.add(row)
            s.flush()
        _update_allocation(s, row, state, nodes, at)
        return row.id


@_guarded
def update_allocation(store: Store, job_id: str, backend_id: str, *,
                      state: str | None = None, nodes: Sequence[str] | None = None,
                      at: datetime | None = None) -> None:
    """Change an allocation's state and/or nodes. ``granted``/``lost``/``released`` set
    their time once; ``lost``/``released`` also mark its held devices lost/released."""
    if state is not None:
        _one_of("allocation state", state, ALLOCATION_STATES)
    at = _at(at)
    with store.transaction(write=True) as s:
        _update_allocation(s, _allocation(s, job_id, backend_id), state, nodes, at)
        _touch(s, job_id, at)


@_guarded
def set_device_state(store: Store, job_id: str, devices: Iterable[DeviceLike], state: str, *,
                     allocation: str | None = None, at: datetime | None = None) -> None:
    """Record devices (created if new) in ``state`` (``DEVICE_STATES``), optionally in the
    allocation with backend id ``allocation``."""
    _one_of("device state", state, DEVICE_STATES)
    at = _at(at)
    with store.transaction(write=True) as s:
        _touch(s, job_id, at)
        alloc_id = _allocation(s, job_id, allocation).id if allocation else None
        change: dict[str, Any] = {"state": state, "updated_at": at}
        if alloc_id is not None:
            change["allocation_id"] = alloc_id
        _set_devices(s, _device_ids(s, job_id, devices, at), change)


@_guarded
def open_generation(store: Store, job_id: str, number: int, layout: str,
                    ranks: Sequence[int], devices: Mapping[int, DeviceLike], *,
                    first_step: int | None = None, at: datetime | None = None) -> int:
    """Open generation ``number``: training under ``layout`` on these vranks; returns its id.

    Args:
        layout: the ParallelConfig as text, e.g. ``dp=2,tp=1,pp=2,dist-opt``.
        ranks: the vrank of every layout rank, in rank order (``Layout.devices``).
        devices: vrank -> device for the whole pool (``alloc.Allocation.vranks``); vranks
            no rank uses are recorded idle.
        first_step: the first step this generation trains.

    The pool's devices become ``held`` (linked to the granted allocation listing their
    node); devices held before and not in the pool become ``released``. A generation still
    open is closed (``superseded by generation N``). Opening the same generation again with
    the same layout and vranks returns its id and writes nothing.

    Raises:
        RecordError: inconsistent arguments, or generation ``number`` exists differently.
    """
    _text("layout", layout, 255)
    if not isinstance(number, int) or number < 0:
        raise RecordError(f"generation number must be a non-negative integer, got {number!r}")
    if not ranks:
        raise RecordError(f"generation {number} has no ranks")
    if len(set(ranks)) != len(ranks):
        raise RecordError(f"generation {number} places two ranks on one vrank: {list(ranks)}")
    missing = sorted(set(ranks) - set(devices))
    if missing:
        raise RecordError(f"generation {number}: vranks {missing} have no device")
    places = [(d.node, d.local) for d in devices.values()]
    if len(set(places)) != len(places):
        raise RecordError(f"generation {number}: two vranks name one device")
    rank_of = {v: r for r, v in enumerate(ranks)}
    wanted = {v: (devices[v].node, devices[v].local, rank_of.get(v)) for v in devices}
    at = _at(at)
    with store.transaction(write=True) as s:
        job = _job(s, job_id)
        existing = s.scalars(select(GenerationRow).where(
            GenerationRow.job_id == job_id, GenerationRow.number == number)).first()
        if existing is not None:
            if existing.layout == layout and _vrank_map(s, existing.id) == wanted:
                return existing.id
            raise RecordError(f"job {job_id} has a generation {number} already, with another "
                              "layout or vranks; nothing was written")
        for open_gen in s.scalars(select(GenerationRow).where(
                GenerationRow.job_id == job_id, GenerationRow.ended_at.is_(None))):
            open_gen.ended_at = at
            open_gen.end_reason = open_gen.end_reason or f"superseded by generation {number}"
        gen = GenerationRow(job_id=job_id, number=number, layout=layout,
                            world_size=len(ranks), started_at=at, steps=0,
                            first_step=first_step)
        s.add(gen)
        s.flush()
        granted = _granted_allocations_by_node(s, job_id)
        pool = sorted(devices.items())
        ids = _device_ids(s, job_id, (d for _, d in pool), at)
        by_allocation: dict[int | None, list[int]] = {}
        for (_vrank, device), did in zip(pool, ids):
            by_allocation.setdefault(granted.get(device.node), []).append(did)
        for alloc_id, group in by_allocation.items():
            held: dict[str, Any] = {"state": DeviceState.HELD, "updated_at": at}
            if alloc_id is not None:
                held["allocation_id"] = alloc_id
            _set_devices(s, group, held)
        gen_id = gen.id
        s.execute(insert(_table(VrankRow)), [
            {"generation_id": gen_id, "vrank": vrank, "layout_rank": rank_of.get(vrank),
             "device_id": did} for (vrank, _device), did in zip(pool, ids)])
        in_pool = set(ids)
        _set_devices(s, [i for i in s.scalars(select(DeviceRow.id).where(
            DeviceRow.job_id == job_id, DeviceRow.state.in_(_ON_THE_JOB)))
            if i not in in_pool], {"state": DeviceState.RELEASED, "updated_at": at})
        job.generation, job.updated_at = number, at
        s.flush()
        return gen.id


@_guarded
def record_progress(store: Store, job_id: str, number: int, *, last_step: int,
                    last_loss: float | None = None, steps: int | None = None,
                    at: datetime | None = None) -> None:
    """Training progress of an open generation (the last completed step, its loss).
    ``steps`` defaults to ``last_step - first_step + 1`` when the first step is known."""
    with store.transaction(write=True) as s:
        gen = _generation(s, job_id, number)
        _progress(gen, last_step, last_loss, steps)
        _touch(s, job_id, _at(at))


@_guarded
def close_generation(store: Store, job_id: str, number: int, *, reason: str,
                     last_step: int | None = None, last_loss: float | None = None,
                     steps: int | None = None, at: datetime | None = None) -> None:
    """End generation ``number`` with why (``resized to dp=4,...``, ``preempted``,
    ``finished``) and its final progress. Closing a closed generation is a no-op."""
    _text("reason", reason, 255)
    with store.transaction(write=True) as s:
        gen = _generation(s, job_id, number)
        if gen.ended_at is not None:
            return
        if last_step is not None:
            _progress(gen, last_step, last_loss, steps)
        elif steps is not None:
            gen.steps = steps
        when = _at(at)
        gen.ended_at, gen.end_reason = when, reason
        _touch(s, job_id, when)


@_guarded
def record_migration_start(store: Store, job_id: str, *, from_generation: int,
                           to_generation: int, plan_digest: str, moved_bytes: int,
                           kept_bytes: int, lower_bound_bytes: int, messages: int, rounds: int,
                           estimated_seconds: float | None = None,
                           event_id: int | None = None, at: datetime | None = None) -> int:
    """Record a migration about to run, with its plan's numbers; returns its id. The same
    unfinished migration (generations and plan digest) recorded again returns its id."""
    _text("plan_digest", plan_digest, 128, empty=True)
    for name, value in (("moved_bytes", moved_bytes), ("kept_bytes", kept_bytes),
                        ("lower_bound_bytes", lower_bound_bytes), ("messages", messages),
                        ("rounds", rounds)):
        if not isinstance(value, int) or value < 0:
            raise RecordError(f"{name} must be a non-negative integer, got {value!r}")
    at = _at(at)
    with store.transaction(write=True) as s:
        _job(s, job_id)
        same = s.scalars(select(MigrationRow).where(
            MigrationRow.job_id == job_id, MigrationRow.from_generation == from_generation,
            MigrationRow.to_generation == to_generation, MigrationRow.plan_digest == plan_digest,
            MigrationRow.outcome.is_(None))).first()
        if same is not None:
            return same.id
        row = MigrationRow(job_id=job_id, event_id=event_id, from_generation=from_generation,
                           to_generation=to_generation, plan_digest=plan_digest,
                           moved_bytes=moved_bytes, kept_bytes=kept_bytes,
                           lower_bound_bytes=lower_bound_bytes, messages=messages,
                           rounds=rounds, estimated_seconds=estimated_seconds, started_at=at)
        _touch(s, job_id, at)
        s.add(row)
        s.flush()
        return row.id


@_guarded
def record_migration_finish(store: Store, migration_id: int, *, outcome: str,
                            measured_seconds: float | None = None,
                            pause_seconds: float | None = None, error: str | None = None,
                            lost_steps: tuple[int, int] | None = None,
                            rebuilt_from: str | None = None,
                            data_seconds: float | None = None,
                            at: datetime | None = None) -> None:
    """Record how a migration ended (``committed`` or ``aborted``), its measured time, the
    workers' timing of the pause (:func:`record_migration_pause` replaces it with the gap
    measured at the step boundaries) and the longest data phase. Repeating the same outcome
    is a no-op.

    ``lost_steps`` (first, last): steps trained and lost with a node whose state no replica
    held (the job rolled back to ``first - 1``); ``rebuilt_from``: where that state came
    from (:data:`REBUILT_FROM`). Only a committed migration rebuilt anything.

    Raises:
        RecordError: unknown migration, it ended with the other outcome already, or lost
            steps that are not a span of trained steps.
    """
    _one_of("outcome", outcome, MIGRATION_OUTCOMES)
    if rebuilt_from is not None:
        _one_of("rebuilt_from", rebuilt_from, REBUILT_FROM)
    if lost_steps is not None:
        first, last = lost_steps
        if not (isinstance(first, int) and isinstance(last, int) and 1 <= first <= last):
            raise RecordError(f"lost_steps must be (first, last) with 1 <= first <= last, got "
                              f"{lost_steps!r}")
    if (lost_steps is not None or rebuilt_from is not None) and outcome != ResizeOutcome.COMMITTED:
        raise RecordError(f"an {outcome} migration rebuilt nothing: lost_steps "
                          f"{lost_steps!r} and rebuilt_from {rebuilt_from!r} need 'committed'")
    with store.transaction(write=True) as s:
        row = s.get(MigrationRow, migration_id)
        if row is None:
            raise RecordError(f"no migration {migration_id}")
        if row.outcome is not None:
            if row.outcome != outcome:
                raise RecordError(f"migration {migration_id} is {row.outcome} already; "
                                  f"cannot record it {outcome}")
            return
        row.outcome, row.measured_seconds, row.pause_seconds = (outcome, measured_seconds,
                                                                pause_seconds)
        when = _at(at)
        row.error, row.ended_at = error, when
        if lost_steps is not None:
            row.lost_first_step, row.lost_last_step = lost_steps
        row.rebuilt_from = rebuilt_from
        row.data_seconds = data_seconds
        _touch(s, row.job_id, when)


@_guarded
def record_migration_pause(store: Store, migration_id: int, *, pause_seconds: float,
                           paused_at: datetime, resumed_at: datetime,
                           preparation_seconds: float, processes: int,
                           stall_seconds: float = 0.0,
                           interrupted_seconds: float = 0.0) -> None:
    """The training pause of a committed migration measured at the step boundaries: the
    largest gap over ``processes`` processes of the new layout, from ``paused_at`` to
    ``resumed_at``, after ``preparation_seconds`` from the decision, in which training
    stopped at most ``stall_seconds`` at once (the boundary that built the new world); of
    the pause, ``interrupted_seconds`` before the step in flight failed (a loss).

    Raises:
        RecordError: unknown or uncommitted migration, or values that do not add up.
    """
    for name, value in (("pause_seconds", pause_seconds),
                        ("preparation_seconds", preparation_seconds),
                        ("stall_seconds", stall_seconds),
                        ("interrupted_seconds", interrupted_seconds)):
        if not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
            raise RecordError(f"{name} must be a finite number >= 0, got {value!r}")
    if interrupted_seconds > pause_seconds:
        raise RecordError(f"interrupted_seconds {interrupted_seconds!r} exceeds the pause "
                          f"{pause_seconds!r} it is part of")
    if not isinstance(processes, int) or processes < 1:
        raise RecordError(f"processes must be an integer >= 1, got {processes!r}")
    if _at(resumed_at) < _at(paused_at):
        raise RecordError(f"resumed_at {resumed_at} is before paused_at {paused_at}")
    with store.transaction(write=True) as s:
        row = _committed_row(s, migration_id, "resumed training")
        row.pause_seconds, row.preparation_seconds = float(pause_seconds), \
            float(preparation_seconds)
        row.paused_at, row.resumed_at = _at(paused_at), _at(resumed_at)
        row.pause_processes = processes
        row.stall_seconds = float(stall_seconds)
        row.interrupted_seconds = float(interrupted_seconds)
        _touch(s, row.job_id, _now())


@_guarded
def record_migration_data(store: Store, migration_id: int, *, data_seconds: float) -> None:
    """The longest data phase of a committed migration, from the workers' answers that came
    after its commit (the coordinator commits a resize from its store's commit decision,
    before most answers come).

    Raises:
        RecordError: unknown or uncommitted migration, or not a finite number >= 0.
    """
    if not isinstance(data_seconds, (int, float)) or not 0 <= data_seconds < float("inf"):
        raise RecordError(f"data_seconds must be a finite number >= 0, got {data_seconds!r}")
    with store.transaction(write=True) as s:
        row = _committed_row(s, migration_id, "has a data phase")
        row.data_seconds = float(data_seconds)
        _touch(s, row.job_id, _now())


def _committed_row(s: Session, migration_id: int, what: str) -> MigrationRow:
    row = s.get(MigrationRow, migration_id)
    if row is None:
        raise RecordError(f"no migration {migration_id}")
    if row.outcome != ResizeOutcome.COMMITTED:
        raise RecordError(f"migration {migration_id} is {row.outcome or 'running'}: only a "
                          f"committed one {what}")
    return row


# ---------------------------------------------------------------- reads


@_guarded
def list_jobs(store: Store, owner_uid: int | None = None) -> list[JobSummary]:
    """Jobs, running ones first, then newest first; only ``owner_uid``'s when given. A
    database from before the job record (policies only) has none."""
    if not store.has_table("jobs"):
        return []
    with store.transaction() as s:
        query = select(JobRow)
        if owner_uid is not None:
            query = query.where(JobRow.owner_uid == owner_uid)
        rows = s.scalars(query).all()
        out = [_summary(s, r) for r in rows]
    return sorted(out, key=lambda j: (j.ended_at is not None, -j.created_at.timestamp(),
                                      j.job_id))


@_guarded
def job_detail(store: Store, job_id: str) -> JobDetail | None:
    """Everything recorded about one job, or None."""
    if not store.has_table("jobs"):
        return None
    with store.transaction() as s:
        row = s.get(JobRow, job_id)
        if row is None:
            return None
        summary = _summary(s, row)
        allocs = s.scalars(select(AllocationRow).where(AllocationRow.job_id == job_id)
                           .order_by(AllocationRow.id)).all()
        backend_of = {a.id: a.backend_id for a in allocs}
        devices = s.scalars(select(DeviceRow).where(DeviceRow.job_id == job_id)
                            .order_by(DeviceRow.node, DeviceRow.local_index)).all()
        gens = s.scalars(select(GenerationRow).where(GenerationRow.job_id == job_id)
                         .order_by(GenerationRow.number)).all()
        migrations = _migrations(s, job_id)
        events = s.scalars(select(EventRow).where(EventRow.job_id == job_id)
                           .order_by(EventRow.id)).all()
        return JobDetail(
            job=summary,
            allocations=tuple(AllocationInfo(a.backend_id, a.role, a.partition_name, a.state,
                                             _split(a.nodes), a.requested_at, a.granted_at,
                                             a.lost_at, a.released_at) for a in allocs),
            devices=tuple(DeviceInfo(d.node, d.local_index, d.state,
                                     backend_of.get(d.allocation_id)
                                     if d.allocation_id is not None else None)
                          for d in devices),
            vranks=_vranks(s, job_id, row.generation),
            generations=tuple(GenerationInfo(g.number, g.layout, g.world_size, g.started_at,
                                             g.ended_at, g.steps, g.first_step, g.last_step,
                                             g.last_loss, g.end_reason) for g in gens),
            migrations=tuple(_migration(m) for m in migrations),
            events=tuple(_event(e) for e in events))


# ---------------------------------------------------------------- helpers


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _at(at: datetime | None) -> datetime:
    if at is None:
        return _now()
    return at.replace(tzinfo=timezone.utc) if at.tzinfo is None else at.astimezone(timezone.utc)


def _iso(t: datetime | None) -> str | None:
    return None if t is None else t.isoformat()


def _one_of(what: str, value: object, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise RecordError(f"unknown {what} {value!r}; use one of: {', '.join(allowed)}")


def _text(what: str, value: object, limit: int, empty: bool = False) -> None:
    if value is None:
        return
    if not isinstance(value, str) or (not value and not empty) or len(value) > limit:
        raise RecordError(f"{what} must be {'a' if empty else 'a non-empty'} string of at "
                          f"most {limit} characters, got {value!r:.80}")


def _nodes(nodes: Sequence[str]) -> str:
    if isinstance(nodes, str):
        raise RecordError(f"nodes must be a list of node names, got the string {nodes!r}")
    bad = [n for n in nodes if not isinstance(n, str) or not n or "," in n]
    if bad:
        raise RecordError(f"invalid node names: {bad!r}")
    return ",".join(nodes)


def _split(nodes: str) -> tuple[str, ...]:
    return tuple(n for n in nodes.split(",") if n)


def _job(s: Session, job_id: str) -> JobRow:
    row = s.get(JobRow, job_id)
    if row is None:
        raise RecordError(f"no job {job_id!r} in the record")
    return row


def _touch(s: Session, job_id: str, at: datetime) -> JobRow:
    """The job, its ``updated_at`` moved to ``at`` (never back): which of two snapshots of
    a job is newer."""
    row = _job(s, job_id)
    if at > row.updated_at:
        row.updated_at = at
    return row


def _find_allocation(s: Session, job_id: str, backend_id: str) -> AllocationRow | None:
    return s.scalars(select(AllocationRow).where(AllocationRow.job_id == job_id,
                                                 AllocationRow.backend_id == backend_id)).first()


def _allocation(s: Session, job_id: str, backend_id: str) -> AllocationRow:
    row = _find_allocation(s, job_id, backend_id)
    if row is None:
        raise RecordError(f"job {job_id} has no allocation {backend_id!r}")
    return row


def _update_allocation(s: Session, row: AllocationRow, state: str | None,
                       nodes: Sequence[str] | None, at: datetime) -> None:
    if nodes is not None:
        row.nodes = _nodes(nodes)
    if state is None or state == row.state:
        return
    row.state = state
    column = _ALLOCATION_TIMES.get(state)
    if column and getattr(row, column) is None:
        setattr(row, column, at)
    device_state = _DEVICE_ON_ALLOCATION.get(state)
    if device_state:
        for dev in s.scalars(select(DeviceRow).where(DeviceRow.allocation_id == row.id,
                                                     DeviceRow.state.in_(_ON_THE_JOB))):
            dev.state, dev.updated_at = device_state, at


def _granted_allocations_by_node(s: Session, job_id: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for a in s.scalars(select(AllocationRow).where(
            AllocationRow.job_id == job_id,
            AllocationRow.state.in_((AllocationState.GRANTED, AllocationState.PREEMPTING))
            ).order_by(AllocationRow.id)):
        for node in _split(a.nodes):
            out[node] = a.id
    return out


def _device_ids(s: Session, job_id: str, devices: Iterable[DeviceLike], at: datetime
                ) -> list[int]:
    """The ids of ``devices`` (created ``held`` when new), with one query for the job's
    devices and one multi-row INSERT (a burst releasing thousands of devices is not a
    query each, nor an ORM object each)."""
    wanted = list(devices)
    for d in wanted:
        if not isinstance(d.node, str) or not d.node or not isinstance(d.local, int) \
                or d.local < 0:
            raise RecordError(f"invalid device {d.node!r}:{d.local!r}")
    known = {(node, local): int(did) for did, node, local in s.execute(
        select(DeviceRow.id, DeviceRow.node, DeviceRow.local_index)
        .where(DeviceRow.job_id == job_id))}
    new = list(dict.fromkeys((d.node, d.local) for d in wanted
                             if (d.node, d.local) not in known))
    if new:
        for did, node, local in s.execute(insert(_table(DeviceRow)).returning(
                DeviceRow.id, DeviceRow.node, DeviceRow.local_index), [
                {"job_id": job_id, "node": node, "local_index": local, "state": DeviceState.HELD,
                 "allocation_id": None, "updated_at": at} for node, local in new]):
            known[(node, local)] = int(did)
    return [known[(d.node, d.local)] for d in wanted]


def _set_devices(s: Session, ids: Sequence[int], values: Mapping[str, Any]) -> None:
    """One UPDATE per 500 devices (by id) with the same ``values``."""
    for chunk in _chunks(sorted(set(ids))):
        s.execute(update(DeviceRow).where(DeviceRow.id.in_(chunk)).values(**values)
                  .execution_options(synchronize_session=False))


def _table(model: type[Any]) -> Table:
    """A model's table, for Core INSERTs (one multi-row statement, no ORM bookkeeping)."""
    return cast(Table, model.__table__)


def _chunks(items: Sequence[Any], size: int = 500) -> Iterable[Sequence[Any]]:
    """``items`` in slices of ``size`` (bound parameters per statement stay few)."""
    return (items[i:i + size] for i in range(0, len(items), size))


def _vrank_map(s: Session, generation_id: int) -> dict[int, tuple[str, int, int | None]]:
    rows = s.execute(select(VrankRow.vrank, DeviceRow.node, DeviceRow.local_index,
                            VrankRow.layout_rank)
                     .join(DeviceRow, DeviceRow.id == VrankRow.device_id)
                     .where(VrankRow.generation_id == generation_id)).all()
    return {v: (node, local, rank) for v, node, local, rank in rows}


def _vranks(s: Session, job_id: str, number: int | None) -> tuple[VrankInfo, ...]:
    if number is None:
        return ()
    rows = s.execute(select(VrankRow.vrank, VrankRow.layout_rank, DeviceRow.node,
                            DeviceRow.local_index)
                     .join(DeviceRow, DeviceRow.id == VrankRow.device_id)
                     .join(GenerationRow, GenerationRow.id == VrankRow.generation_id)
                     .where(GenerationRow.job_id == job_id, GenerationRow.number == number)
                     .order_by(VrankRow.vrank)).all()
    return tuple(VrankInfo(number, v, rank, node, local) for v, rank, node, local in rows)


def _generation(s: Session, job_id: str, number: int) -> GenerationRow:
    row = s.scalars(select(GenerationRow).where(GenerationRow.job_id == job_id,
                                                GenerationRow.number == number)).first()
    if row is None:
        raise RecordError(f"job {job_id} has no generation {number}")
    return row


def _progress(gen: GenerationRow, last_step: int, last_loss: float | None,
              steps: int | None) -> None:
    if not isinstance(last_step, int) or last_step < 0:
        raise RecordError(f"last_step must be a non-negative integer, got {last_step!r}")
    gen.last_step = last_step
    if last_loss is not None:
        gen.last_loss = float(last_loss)
    if steps is not None:
        gen.steps = steps
    elif gen.first_step is not None:
        gen.steps = max(0, last_step - gen.first_step + 1)


def _event_by_key(store: Store, job_id: str, key: str) -> int | None:
    with store.transaction() as s:
        return s.scalars(select(EventRow.id).where(EventRow.job_id == job_id,
                                                   EventRow.dedup_key == key)).first()


def _summary(s: Session, row: JobRow) -> JobSummary:
    gen = None
    if row.generation is not None:
        gen = s.scalars(select(GenerationRow).where(GenerationRow.job_id == row.job_id,
                                                    GenerationRow.number == row.generation)
                        ).first()
    nodes: tuple[str, ...] = ()
    if gen is not None:
        nodes = tuple(s.scalars(select(DeviceRow.node).distinct()
                                .join(VrankRow, VrankRow.device_id == DeviceRow.id)
                                .where(VrankRow.generation_id == gen.id,
                                       VrankRow.layout_rank.is_not(None))
                                .order_by(DeviceRow.node)).all())
    pending = s.scalar(select(func.count()).select_from(EventRow).where(
        EventRow.job_id == row.job_id, EventRow.handled_at.is_(None))) or 0
    migrations = s.scalar(select(func.count()).select_from(MigrationRow).where(
        MigrationRow.job_id == row.job_id)) or 0
    return JobSummary(row.job_id, row.name, row.owner_uid, row.owner_name, row.state,
                      row.reason, row.backend, row.model, row.partition_name, row.account,
                      row.coordinator, row.generation, gen.layout if gen else None,
                      gen.world_size if gen else 0, nodes, row.created_at, row.updated_at,
                      row.ended_at, pending, migrations)


def _event(r: EventRow) -> EventInfo:
    try:
        payload = None if r.payload is None else json.loads(r.payload)
    except ValueError:
        payload = r.payload
    return EventInfo(r.id, r.kind, r.source, payload, r.deadline, r.received_at, r.handled_at,
                     r.outcome, r.dedup_key)


# migrations' columns added after 0002_jobs: a record written before them (a published
# snapshot of an older job, read by a newer status) has none, and reads as "nothing lost"
_LATER_MIGRATION_COLUMNS = ("lost_first_step", "lost_last_step", "rebuilt_from",
                            "data_seconds", "preparation_seconds", "paused_at", "resumed_at",
                            "pause_processes", "stall_seconds", "interrupted_seconds")


def _migrations(s: Session, job_id: str) -> list[Any]:
    from sqlalchemy import inspect
    from sqlalchemy.orm import defer

    have = {c["name"] for c in inspect(s.connection()).get_columns("migrations")}
    missing = [c for c in _LATER_MIGRATION_COLUMNS if c not in have]
    query = select(MigrationRow).where(MigrationRow.job_id == job_id)
    if missing:
        query = query.options(*(defer(getattr(MigrationRow, c), raiseload=True)
                                for c in missing))
    present = frozenset(c for c in _LATER_MIGRATION_COLUMNS if c in have)
    return [(m, present) for m in s.scalars(query.order_by(MigrationRow.id)).all()]


def _migration(row: tuple[MigrationRow, frozenset[str]]) -> MigrationInfo:
    m, present = row

    def later(column: str) -> Any:
        return getattr(m, column) if column in present else None

    lost = (later("lost_first_step"), later("lost_last_step"))
    return MigrationInfo(m.id, m.from_generation, m.to_generation, m.plan_digest,
                         m.moved_bytes, m.kept_bytes, m.lower_bound_bytes, m.messages,
                         m.rounds, m.estimated_seconds, m.measured_seconds, m.pause_seconds,
                         m.outcome, m.error, m.started_at, m.ended_at, m.event_id,
                         None if lost[0] is None or lost[1] is None else (lost[0], lost[1]),
                         later("rebuilt_from"), later("data_seconds"),
                         later("preparation_seconds"), later("paused_at"),
                         later("resumed_at"), later("pause_processes"),
                         later("stall_seconds"), later("interrupted_seconds"))
