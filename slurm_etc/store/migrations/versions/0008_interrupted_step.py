"""The step a loss interrupted: of a migration's pause, the part before the step in flight
failed on the process whose gap the pause is (a node lost without notice: the step's work
was lost with it; the rest of the gap is the recovery). ``migrations.interrupted_seconds``;
NULL: not measured (a record of before, or a migration not committed); 0: no step failed.

Revision ID: 0008_interrupted_step
Revises: 0007_lifecycle_checks
Create Date: 2026-12-03
"""
import sqlalchemy as sa
from alembic import op

revision = "0008_interrupted_step"
down_revision = "0007_lifecycle_checks"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("migrations") as batch:
        batch.add_column(sa.Column("interrupted_seconds", sa.Double))
        batch.create_check_constraint(
            "ck_migrations_interrupted",
            "interrupted_seconds IS NULL OR (interrupted_seconds >= 0 AND "
            "(pause_seconds IS NULL OR interrupted_seconds <= pause_seconds))")


def downgrade() -> None:
    with op.batch_alter_table("migrations") as batch:
        batch.drop_constraint("ck_migrations_interrupted", type_="check")
        batch.drop_column("interrupted_seconds")
