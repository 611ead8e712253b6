"""Admin resize policies per partition or account.

Revision ID: 0001_policies
Revises:
Create Date: 2026-11-30
"""
import sqlalchemy as sa
from alembic import op

revision = "0001_policies"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "policies",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("scope_kind", sa.String(16), nullable=False),
        sa.Column("scope_name", sa.String(64), nullable=False),
        sa.Column("min_nodes", sa.Integer),
        sa.Column("max_nodes", sa.Integer),
        sa.Column("allowed_tp", sa.String(128)),
        sa.Column("allowed_pp", sa.String(128)),
        sa.Column("grow", sa.Boolean),
        sa.Column("grow_partition", sa.String(64)),
        sa.Column("grow_qos", sa.String(64)),
        sa.Column("preempt_grace_s", sa.Integer),
        sa.Column("max_resizes_per_hour", sa.Integer),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_by", sa.String(64), nullable=False),
        sa.UniqueConstraint("scope_kind", "scope_name", name="uq_policies_scope"),
        sa.CheckConstraint("scope_kind IN ('partition', 'account')", name="ck_policies_kind"),
        sa.CheckConstraint("min_nodes IS NULL OR min_nodes >= 1", name="ck_policies_min_nodes"),
        sa.CheckConstraint("max_nodes IS NULL OR max_nodes >= 1", name="ck_policies_max_nodes"),
        sa.CheckConstraint("min_nodes IS NULL OR max_nodes IS NULL OR min_nodes <= max_nodes",
                           name="ck_policies_min_le_max"),
        sa.CheckConstraint("preempt_grace_s IS NULL OR preempt_grace_s >= 0",
                           name="ck_policies_grace"),
        sa.CheckConstraint("max_resizes_per_hour IS NULL OR max_resizes_per_hour >= 0",
                           name="ck_policies_resizes"),
    )


def downgrade() -> None:
    op.drop_table("policies")
