"""The stall before the pause: the widest gap between two old-layout steps of any process
while the resize was prepared beside training (a stayer builds the new world at one step
boundary). ``migrations.stall_seconds``; NULL: not measured (a record of before, or a
migration not committed); 0: training never stopped before the pause.

Revision ID: 0006_preparation_stall
Revises: 0005_request_patience
Create Date: 2026-12-02
"""
import sqlalchemy as sa
from alembic import op

revision = "0006_preparation_stall"
down_revision = "0005_request_patience"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("migrations") as batch:
        batch.add_column(sa.Column("stall_seconds", sa.Double))
        batch.create_check_constraint(
            "ck_migrations_stall", "stall_seconds IS NULL OR stall_seconds >= 0")


def downgrade() -> None:
    with op.batch_alter_table("migrations") as batch:
        batch.drop_constraint("ck_migrations_stall", type_="check")
        batch.drop_column("stall_seconds")
