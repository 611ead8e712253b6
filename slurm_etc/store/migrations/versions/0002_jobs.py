"""The job record: jobs, allocations, devices, generations, vranks, events, migrations.

Dialect-neutral (SQLite, MariaDB/MySQL, PostgreSQL): bounded VARCHARs for everything that is
indexed, BIGINT byte counts, DOUBLE seconds, timestamps in UTC with microseconds.

Revision ID: 0002_jobs
Revises: 0001_policies
Create Date: 2026-11-30
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0002_jobs"
down_revision = "0001_policies"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def _job_fk(table: str) -> sa.Column:
    return sa.Column("job_id", sa.String(64),
                     sa.ForeignKey("jobs.job_id", name=f"fk_{table}_job", ondelete="CASCADE"),
                     nullable=False)


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("job_id", sa.String(64), primary_key=True),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("owner_uid", sa.Integer, nullable=False),
        sa.Column("owner_name", sa.String(64), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("reason", sa.String(255)),
        sa.Column("backend", sa.String(16), nullable=False),
        sa.Column("model", sa.String(255)),
        sa.Column("partition_name", sa.String(64)),
        sa.Column("account", sa.String(64)),
        sa.Column("coordinator", sa.String(255)),
        sa.Column("generation", sa.Integer),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.Column("ended_at", TS),
    )
    op.create_index("ix_jobs_owner_uid", "jobs", ["owner_uid"])

    op.create_table(
        "allocations",
        sa.Column("id", sa.Integer, primary_key=True),
        _job_fk("allocations"),
        sa.Column("backend_id", sa.String(64), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("partition_name", sa.String(64)),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("nodes", sa.Text, nullable=False),
        sa.Column("requested_at", TS, nullable=False),
        sa.Column("granted_at", TS),
        sa.Column("lost_at", TS),
        sa.Column("released_at", TS),
        sa.UniqueConstraint("job_id", "backend_id", name="uq_allocations_backend"),
    )

    op.create_table(
        "devices",
        sa.Column("id", sa.Integer, primary_key=True),
        _job_fk("devices"),
        sa.Column("node", sa.String(255), nullable=False),
        sa.Column("local_index", sa.Integer, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("allocation_id", sa.Integer,
                  sa.ForeignKey("allocations.id", name="fk_devices_allocation",
                                ondelete="SET NULL")),
        sa.Column("updated_at", TS, nullable=False),
        sa.UniqueConstraint("job_id", "node", "local_index", name="uq_devices_node_local"),
    )

    op.create_table(
        "generations",
        sa.Column("id", sa.Integer, primary_key=True),
        _job_fk("generations"),
        sa.Column("number", sa.Integer, nullable=False),
        sa.Column("layout", sa.String(255), nullable=False),
        sa.Column("world_size", sa.Integer, nullable=False),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("ended_at", TS),
        sa.Column("steps", sa.Integer, nullable=False),
        sa.Column("first_step", sa.Integer),
        sa.Column("last_step", sa.Integer),
        sa.Column("last_loss", sa.Double),
        sa.Column("end_reason", sa.String(255)),
        sa.UniqueConstraint("job_id", "number", name="uq_generations_number"),
        sa.CheckConstraint("number >= 0", name="ck_generations_number"),
        sa.CheckConstraint("world_size >= 1", name="ck_generations_world_size"),
        sa.CheckConstraint("steps >= 0", name="ck_generations_steps"),
    )

    op.create_table(
        "vranks",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("generation_id", sa.Integer,
                  sa.ForeignKey("generations.id", name="fk_vranks_generation",
                                ondelete="CASCADE"),
                  nullable=False),
        sa.Column("vrank", sa.Integer, nullable=False),
        sa.Column("layout_rank", sa.Integer),
        sa.Column("device_id", sa.Integer,
                  sa.ForeignKey("devices.id", name="fk_vranks_device", ondelete="CASCADE"),
                  nullable=False),
        sa.UniqueConstraint("generation_id", "vrank", name="uq_vranks_vrank"),
        sa.UniqueConstraint("generation_id", "device_id", name="uq_vranks_device"),
    )

    op.create_table(
        "events",
        sa.Column("id", sa.Integer, primary_key=True),
        _job_fk("events"),
        sa.Column("dedup_key", sa.String(128)),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("source", sa.String(64), nullable=False),
        sa.Column("payload", sa.Text),
        sa.Column("deadline", TS),
        sa.Column("received_at", TS, nullable=False),
        sa.Column("handled_at", TS),
        sa.Column("outcome", sa.String(255)),
        sa.UniqueConstraint("job_id", "dedup_key", name="uq_events_key"),
    )
    op.create_index("ix_events_pending", "events", ["job_id", "handled_at"])

    op.create_table(
        "migrations",
        sa.Column("id", sa.Integer, primary_key=True),
        _job_fk("migrations"),
        sa.Column("event_id", sa.Integer,
                  sa.ForeignKey("events.id", name="fk_migrations_event", ondelete="SET NULL")),
        sa.Column("from_generation", sa.Integer, nullable=False),
        sa.Column("to_generation", sa.Integer, nullable=False),
        sa.Column("plan_digest", sa.String(128), nullable=False),
        sa.Column("moved_bytes", sa.BigInteger, nullable=False),
        sa.Column("kept_bytes", sa.BigInteger, nullable=False),
        sa.Column("lower_bound_bytes", sa.BigInteger, nullable=False),
        sa.Column("messages", sa.Integer, nullable=False),
        sa.Column("rounds", sa.Integer, nullable=False),
        sa.Column("estimated_seconds", sa.Double),
        sa.Column("measured_seconds", sa.Double),
        sa.Column("pause_seconds", sa.Double),
        sa.Column("outcome", sa.String(16)),
        sa.Column("error", sa.Text),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("ended_at", TS),
        sa.CheckConstraint("moved_bytes >= 0 AND kept_bytes >= 0 AND lower_bound_bytes >= 0",
                           name="ck_migrations_bytes"),
        sa.CheckConstraint("outcome IS NULL OR outcome IN ('committed', 'aborted')",
                           name="ck_migrations_outcome"),
    )
    op.create_index("ix_migrations_job", "migrations", ["job_id", "to_generation"])


def downgrade() -> None:
    op.drop_index("ix_migrations_job", table_name="migrations")
    op.drop_table("migrations")
    op.drop_index("ix_events_pending", table_name="events")
    op.drop_table("events")
    op.drop_table("vranks")
    op.drop_table("generations")
    op.drop_table("devices")
    op.drop_table("allocations")
    op.drop_index("ix_jobs_owner_uid", table_name="jobs")
    op.drop_table("jobs")
