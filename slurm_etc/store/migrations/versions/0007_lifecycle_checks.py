"""The lifecycles in the schema: a job's, an allocation's and a device's state, an
allocation's role and a job's backend are each one of ``slurm_etc.lifecycle``'s values,
checked by the database (before, only by the writers of ``store/jobs.py``).

The values are written out here, not imported: a migration describes the schema of its
revision, whatever the enums become later.

Revision ID: 0007_lifecycle_checks
Revises: 0006_preparation_stall
Create Date: 2026-12-03
"""
from alembic import op

revision = "0007_lifecycle_checks"
down_revision = "0006_preparation_stall"
branch_labels = None
depends_on = None

CHECKS = {
    "jobs": [
        ("ck_jobs_state", "state IN ('starting', 'running', 'resizing', 'stopping', "
                          "'finished', 'failed', 'cancelled')"),
        ("ck_jobs_backend", "backend IN ('local', 'slurm')"),
    ],
    "allocations": [
        ("ck_allocations_state", "state IN ('requested', 'granted', 'preempting', 'lost', "
                                 "'released')"),
        ("ck_allocations_role", "role IN ('anchor', 'member')"),
    ],
    "devices": [
        ("ck_devices_state", "state IN ('held', 'leaving', 'lost', 'released')"),
    ],
}


def upgrade() -> None:
    for table, checks in CHECKS.items():
        with op.batch_alter_table(table) as batch:
            for name, condition in checks:
                batch.create_check_constraint(name, condition)


def downgrade() -> None:
    for table, checks in CHECKS.items():
        with op.batch_alter_table(table) as batch:
            for name, _ in checks:
                batch.drop_constraint(name, type_="check")
