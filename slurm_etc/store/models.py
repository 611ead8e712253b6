"""ORM tables: admin policies, and the job record (jobs, allocations, devices, generations
and their vranks, events, migrations). The schema itself grows only by Alembic migrations in
``migrations/versions``; these classes mirror it."""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    DateTime,
    Double,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator, TypeEngine

from ..lifecycle import (
    AllocationRole,
    AllocationState,
    Backend,
    DeviceState,
    JobState,
    ResizeOutcome,
    sql_in,
)


class Base(DeclarativeBase):
    """Declarative base of every slurm-etc table."""


class PolicyRow(Base):
    """One admin resize policy: the fields set for one partition or account (NULL: unset).

    ``allowed_tp``/``allowed_pp`` are comma lists (``1,2,4``). The checks repeat the
    validation of ``policy.rules.ResizePolicy`` so that no other writer can store nonsense.
    """

    __tablename__ = "policies"
    __table_args__ = (
        UniqueConstraint("scope_kind", "scope_name", name="uq_policies_scope"),
        CheckConstraint("scope_kind IN ('partition', 'account')", name="ck_policies_kind"),
        CheckConstraint("min_nodes IS NULL OR min_nodes >= 1", name="ck_policies_min_nodes"),
        CheckConstraint("max_nodes IS NULL OR max_nodes >= 1", name="ck_policies_max_nodes"),
        CheckConstraint("min_nodes IS NULL OR max_nodes IS NULL OR min_nodes <= max_nodes",
                        name="ck_policies_min_le_max"),
        CheckConstraint("preempt_grace_s IS NULL OR preempt_grace_s >= 0",
                        name="ck_policies_grace"),
        CheckConstraint("max_resizes_per_hour IS NULL OR max_resizes_per_hour >= 0",
                        name="ck_policies_resizes"),
        CheckConstraint("request_patience_s IS NULL OR request_patience_s >= 1",
                        name="ck_policies_patience"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    scope_kind: Mapped[str] = mapped_column(String(16))
    scope_name: Mapped[str] = mapped_column(String(64))
    min_nodes: Mapped[int | None]
    max_nodes: Mapped[int | None]
    allowed_tp: Mapped[str | None] = mapped_column(String(128))
    allowed_pp: Mapped[str | None] = mapped_column(String(128))
    grow: Mapped[bool | None]
    grow_partition: Mapped[str | None] = mapped_column(String(64))
    grow_qos: Mapped[str | None] = mapped_column(String(64))
    preempt_grace_s: Mapped[int | None]
    max_resizes_per_hour: Mapped[int | None]
    request_patience_s: Mapped[int | None]
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    updated_by: Mapped[str] = mapped_column(String(64))


class Timestamp(TypeDecorator[datetime]):
    """A UTC instant: aware datetimes in, aware UTC datetimes out, on every dialect.

    PostgreSQL stores it as ``timestamptz``; SQLite and MariaDB/MySQL as naive UTC (with
    microseconds: MariaDB's plain DATETIME would drop them). Naive input counts as UTC.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name in ("mysql", "mariadb"):
            return dialect.type_descriptor(mysql.DATETIME(fsp=6))
        return dialect.type_descriptor(DateTime(timezone=True))

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        utc = value.replace(tzinfo=timezone.utc) if value.tzinfo is None \
            else value.astimezone(timezone.utc)
        return utc if dialect.name == "postgresql" else utc.replace(tzinfo=None)

    def process_result_value(self, value: datetime | None,
                             dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None \
            else value.astimezone(timezone.utc)


class JobRow(Base):
    """One elastic job: who owns it, what it trains, where its coordinator answers.

    ``state`` is what the coordinator observed last (``lifecycle.JobState``); ``generation``
    the number of the generation training now (None before the first).
    """

    __tablename__ = "jobs"
    __table_args__ = (
        Index("ix_jobs_owner_uid", "owner_uid"),
        CheckConstraint(sql_in("state", JobState), name="ck_jobs_state"),
        CheckConstraint(sql_in("backend", Backend), name="ck_jobs_backend"),
    )

    job_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(255))
    owner_uid: Mapped[int] = mapped_column(Integer)
    owner_name: Mapped[str] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(String(255))
    backend: Mapped[str] = mapped_column(String(16))
    model: Mapped[str | None] = mapped_column(String(255))
    partition_name: Mapped[str | None] = mapped_column(String(64))
    account: Mapped[str | None] = mapped_column(String(64))
    coordinator: Mapped[str | None] = mapped_column(String(255))
    generation: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(Timestamp())
    updated_at: Mapped[datetime] = mapped_column(Timestamp())
    ended_at: Mapped[datetime | None] = mapped_column(Timestamp())


class AllocationRow(Base):
    """One backend allocation of a job (a Slurm job id): the anchor or a member."""

    __tablename__ = "allocations"
    __table_args__ = (
        UniqueConstraint("job_id", "backend_id", name="uq_allocations_backend"),
        CheckConstraint(sql_in("state", AllocationState), name="ck_allocations_state"),
        CheckConstraint(sql_in("role", AllocationRole), name="ck_allocations_role"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("jobs.job_id", name="fk_allocations_job", ondelete="CASCADE"))
    backend_id: Mapped[str] = mapped_column(String(64))
    role: Mapped[str] = mapped_column(String(16))
    partition_name: Mapped[str | None] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(16))
    nodes: Mapped[str] = mapped_column(Text)
    requested_at: Mapped[datetime] = mapped_column(Timestamp())
    granted_at: Mapped[datetime | None] = mapped_column(Timestamp())
    lost_at: Mapped[datetime | None] = mapped_column(Timestamp())
    released_at: Mapped[datetime | None] = mapped_column(Timestamp())


class DeviceRow(Base):
    """One device a job holds or held: (node, local index), its state and allocation."""

    __tablename__ = "devices"
    __table_args__ = (
        UniqueConstraint("job_id", "node", "local_index", name="uq_devices_node_local"),
        CheckConstraint(sql_in("state", DeviceState), name="ck_devices_state"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("jobs.job_id", name="fk_devices_job", ondelete="CASCADE"))
    node: Mapped[str] = mapped_column(String(255))
    local_index: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16))
    allocation_id: Mapped[int | None] = mapped_column(
        Integer, ForeignKey("allocations.id", name="fk_devices_allocation",
                            ondelete="SET NULL"))
    updated_at: Mapped[datetime] = mapped_column(Timestamp())


class GenerationRow(Base):
    """One period of training under one layout (``dp=2,tp=1,pp=2,dist-opt``)."""

    __tablename__ = "generations"
    __table_args__ = (
        UniqueConstraint("job_id", "number", name="uq_generations_number"),
        CheckConstraint("number >= 0", name="ck_generations_number"),
        CheckConstraint("world_size >= 1", name="ck_generations_world_size"),
        CheckConstraint("steps >= 0", name="ck_generations_steps"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("jobs.job_id", name="fk_generations_job", ondelete="CASCADE"))
    number: Mapped[int] = mapped_column(Integer)
    layout: Mapped[str] = mapped_column(String(255))
    world_size: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(Timestamp())
    ended_at: Mapped[datetime | None] = mapped_column(Timestamp())
    steps: Mapped[int] = mapped_column(Integer)
    first_step: Mapped[int | None] = mapped_column(Integer)
    last_step: Mapped[int | None] = mapped_column(Integer)
    last_loss: Mapped[float | None] = mapped_column(Double)
    end_reason: Mapped[str | None] = mapped_column(String(255))


class VrankRow(Base):
    """A vrank of a generation: the device it names and the layout rank on it (None: the
    device is in the pool but idle under this layout)."""

    __tablename__ = "vranks"
    __table_args__ = (
        UniqueConstraint("generation_id", "vrank", name="uq_vranks_vrank"),
        UniqueConstraint("generation_id", "device_id", name="uq_vranks_device"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    generation_id: Mapped[int] = mapped_column(
        Integer, ForeignKey("generations.id", name="fk_vranks_generation", ondelete="CASCADE"))
    vrank: Mapped[int] = mapped_column(Integer)
    layout_rank: Mapped[int | None] = mapped_column(Integer)
    device_id: Mapped[int] = mapped_column(
        Integer, ForeignKey("devices.id", name="fk_vranks_device", ondelete="CASCADE"))


class EventRow(Base):
    """Something that happened to a job (grant, preempt-notice, loss, ...), recorded before
    it is acted on; ``dedup_key`` makes a repeated recording a no-op."""

    __tablename__ = "events"
    __table_args__ = (
        UniqueConstraint("job_id", "dedup_key", name="uq_events_key"),
        Index("ix_events_pending", "job_id", "handled_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("jobs.job_id", name="fk_events_job", ondelete="CASCADE"))
    dedup_key: Mapped[str | None] = mapped_column(String(128))
    kind: Mapped[str] = mapped_column(String(32))
    source: Mapped[str] = mapped_column(String(64))
    payload: Mapped[str | None] = mapped_column(Text)
    deadline: Mapped[datetime | None] = mapped_column(Timestamp())
    received_at: Mapped[datetime] = mapped_column(Timestamp())
    handled_at: Mapped[datetime | None] = mapped_column(Timestamp())
    outcome: Mapped[str | None] = mapped_column(String(255))


class MigrationRow(Base):
    """One state migration between generations: the plan's numbers, then what happened.

    ``lost_first_step``..``lost_last_step``: steps trained, then lost with a node whose state
    no replica held (the job rolled back and trains them again); ``rebuilt_from``: where that
    state came from (``peer-copies`` or ``checkpoint``).

    ``pause_seconds``: the largest training gap over the new layout's processes, measured at
    the step boundaries, once ``pause_processes`` processes reported it (NULL: not yet; the
    workers' own timing of the resize stands meanwhile), lying from ``paused_at`` to
    ``resumed_at``; ``preparation_seconds``: decision to ``paused_at`` (the old layout
    trained through it); ``data_seconds``: the longest data phase of any process;
    ``stall_seconds``: the widest gap between two old-layout steps of any process while the
    resize was prepared beside training (the boundary that built the new world; 0: none);
    ``interrupted_seconds``: of the pause, the part before the step in flight failed (a loss
    without notice: that step's work was lost with the node; the rest is the recovery)."""

    __tablename__ = "migrations"
    __table_args__ = (
        CheckConstraint("moved_bytes >= 0 AND kept_bytes >= 0 AND lower_bound_bytes >= 0",
                        name="ck_migrations_bytes"),
        CheckConstraint(f"outcome IS NULL OR {sql_in('outcome', ResizeOutcome)}",
                        name="ck_migrations_outcome"),
        CheckConstraint("(lost_first_step IS NULL AND lost_last_step IS NULL) OR "
                        "(lost_first_step IS NOT NULL AND lost_last_step IS NOT NULL AND "
                        "lost_first_step >= 1 AND lost_last_step >= lost_first_step)",
                        name="ck_migrations_lost_steps"),
        CheckConstraint("rebuilt_from IS NULL OR rebuilt_from IN ('peer-copies', "
                        "'checkpoint')", name="ck_migrations_rebuilt_from"),
        CheckConstraint("pause_processes IS NULL OR pause_processes >= 1",
                        name="ck_migrations_pause_processes"),
        CheckConstraint("stall_seconds IS NULL OR stall_seconds >= 0",
                        name="ck_migrations_stall"),
        CheckConstraint("interrupted_seconds IS NULL OR (interrupted_seconds >= 0 AND "
                        "(pause_seconds IS NULL OR interrupted_seconds <= pause_seconds))",
                        name="ck_migrations_interrupted"),
        Index("ix_migrations_job", "job_id", "to_generation"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("jobs.job_id", name="fk_migrations_job", ondelete="CASCADE"))
    event_id: Mapped[int | None] = mapped_column(
        Integer, ForeignKey("events.id", name="fk_migrations_event", ondelete="SET NULL"))
    from_generation: Mapped[int] = mapped_column(Integer)
    to_generation: Mapped[int] = mapped_column(Integer)
    plan_digest: Mapped[str] = mapped_column(String(128))
    moved_bytes: Mapped[int] = mapped_column(BigInteger)
    kept_bytes: Mapped[int] = mapped_column(BigInteger)
    lower_bound_bytes: Mapped[int] = mapped_column(BigInteger)
    messages: Mapped[int] = mapped_column(Integer)
    rounds: Mapped[int] = mapped_column(Integer)
    estimated_seconds: Mapped[float | None] = mapped_column(Double)
    measured_seconds: Mapped[float | None] = mapped_column(Double)
    pause_seconds: Mapped[float | None] = mapped_column(Double)
    outcome: Mapped[str | None] = mapped_column(String(16))
    error: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[datetime] = mapped_column(Timestamp())
    ended_at: Mapped[datetime | None] = mapped_column(Timestamp())
    lost_first_step: Mapped[int | None] = mapped_column(Integer)
    lost_last_step: Mapped[int | None] = mapped_column(Integer)
    rebuilt_from: Mapped[str | None] = mapped_column(String(16))
    data_seconds: Mapped[float | None] = mapped_column(Double)
    preparation_seconds: Mapped[float | None] = mapped_column(Double)
    paused_at: Mapped[datetime | None] = mapped_column(Timestamp())
    resumed_at: Mapped[datetime | None] = mapped_column(Timestamp())
    pause_processes: Mapped[int | None] = mapped_column(Integer)
    stall_seconds: Mapped[float | None] = mapped_column(Double)
    interrupted_seconds: Mapped[float | None] = mapped_column(Double)
