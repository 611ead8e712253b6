"""The request patience as a policy field: how long a node request may pend before it is
withdrawn and asked again smaller (``policies.request_patience_s``; NULL: unset, the default
of 300 s applies).

Revision ID: 0005_request_patience
Revises: 0004_measured_pause
Create Date: 2026-12-02
"""
import sqlalchemy as sa
from alembic import op

revision = "0005_request_patience"
down_revision = "0004_measured_pause"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("policies") as batch:
        batch.add_column(sa.Column("request_patience_s", sa.Integer))
        batch.create_check_constraint(
            "ck_policies_patience", "request_patience_s IS NULL OR request_patience_s >= 1")


def downgrade() -> None:
    with op.batch_alter_table("policies") as batch:
        batch.drop_constraint("ck_policies_patience", type_="check")
        batch.drop_column("request_patience_s")
