"""Steps lost with a node: what a migration that rebuilt lost state rolled back over.

A node lost without grace whose state no surviving replica held is rebuilt from peer
copies or the last periodic checkpoint; the steps trained after that copy are lost and
trained again. ``lost_first_step``/``lost_last_step`` are that span (NULL: none lost),
``rebuilt_from`` where the lost state came from (NULL: surviving replicas or nothing lost).

Revision ID: 0003_lost_steps
Revises: 0002_jobs
Create Date: 2026-12-01
"""
import sqlalchemy as sa
from alembic import op

revision = "0003_lost_steps"
down_revision = "0002_jobs"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("migrations") as batch:
        batch.add_column(sa.Column("lost_first_step", sa.Integer))
        batch.add_column(sa.Column("lost_last_step", sa.Integer))
        batch.add_column(sa.Column("rebuilt_from", sa.String(16)))
        batch.create_check_constraint(
            "ck_migrations_lost_steps",
            "(lost_first_step IS NULL AND lost_last_step IS NULL) OR "
            "(lost_first_step IS NOT NULL AND lost_last_step IS NOT NULL AND "
            "lost_first_step >= 1 AND lost_last_step >= lost_first_step)")
        batch.create_check_constraint(
            "ck_migrations_rebuilt_from",
            "rebuilt_from IS NULL OR rebuilt_from IN ('peer-copies', 'checkpoint')")


def downgrade() -> None:
    with op.batch_alter_table("migrations") as batch:
        batch.drop_constraint("ck_migrations_rebuilt_from", type_="check")
        batch.drop_constraint("ck_migrations_lost_steps", type_="check")
        batch.drop_column("rebuilt_from")
        batch.drop_column("lost_last_step")
        batch.drop_column("lost_first_step")
