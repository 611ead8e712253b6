"""ORM tables. The coordinator extends this module with jobs, allocations and migrations."""
from __future__ import annotations

from datetime import datetime

from sqlalchemy import CheckConstraint, DateTime, Integer, String, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


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
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    updated_by: Mapped[str] = mapped_column(String(64))
