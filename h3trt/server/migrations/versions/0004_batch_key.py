"""A queued job's batch key (request/request.py BatchKey.digest), stored at admission so that a worker's claim takes
the oldest queued job and, in the same transaction, later queued jobs of the same key that share its batched denoise
(server/store.py claim_batch). Rows written before keep NULL: each runs alone.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("batch_key", sa.String(64)))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("batch_key")
