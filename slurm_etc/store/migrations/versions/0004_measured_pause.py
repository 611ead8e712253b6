"""The pause measured at the step boundaries, the data phase, the preparation before it.

``pause_seconds`` becomes the largest gap over the new layout's processes between the end of
a process's last step in the old layout and the start of its first step in the new one, once
every process reported it (``pause_processes``: over how many; NULL: not measured yet, and
``pause_seconds`` is the workers' own timing of the resize). ``paused_at``/``resumed_at``
are where that gap lies; ``preparation_seconds`` the time from the coordinator's decision to
``paused_at`` (planning, joiners' warm-up: the old layout trained through it);
``data_seconds`` the longest data phase any process reported.

Revision ID: 0004_measured_pause
Revises: 0003_lost_steps
Create Date: 2026-12-02
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0004_measured_pause"
down_revision = "0003_lost_steps"
branch_labels = None
depends_on = None

# as in 0002_jobs: microseconds on MariaDB/MySQL too
TS = sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def upgrade() -> None:
    with op.batch_alter_table("migrations") as batch:
        batch.add_column(sa.Column("data_seconds", sa.Double))
        batch.add_column(sa.Column("preparation_seconds", sa.Double))
        batch.add_column(sa.Column("paused_at", TS))
        batch.add_column(sa.Column("resumed_at", TS))
        batch.add_column(sa.Column("pause_processes", sa.Integer))
        batch.create_check_constraint(
            "ck_migrations_pause_processes",
            "pause_processes IS NULL OR pause_processes >= 1")


def downgrade() -> None:
    with op.batch_alter_table("migrations") as batch:
        batch.drop_constraint("ck_migrations_pause_processes", type_="check")
        batch.drop_column("pause_processes")
        batch.drop_column("resumed_at")
        batch.drop_column("paused_at")
        batch.drop_column("preparation_seconds")
        batch.drop_column("data_seconds")
