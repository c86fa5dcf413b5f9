"""Each claim of a job writes its clip under names of its own (server/storage.py clip_key(id, attempt)); a completed
row names the claim whose files are its clip, so a worker that writes late after its lease ran out can no longer
replace the clip of the claim that completed the job. Rows completed before keep NULL: their clip is clips/<id>.mp4.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("clip_attempt", sa.Integer))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("clip_attempt")
