"""Say when an attempt's episode rows were reconciled from its archive.

Why: per episode the archive member is written (fsynced) before the database row, so a
database outage can leave episodes archived with no row (issue 27: an attempt's archive held
41 episodes and the database 40). `dispatch --follow` and `packbench db reconcile` now insert
those rows from the archive, each checked against the member hashes first, and the attempt
records it: `reconciled_at` (the last time rows were inserted), `reconciled_episodes` (how
many in all) and `reconciled_check` (what the members were checked against: `manifest`, the
sealed archive's SHA-256 entries; `writer`, the live writer's table that becomes the
manifest; `crc32`, an unsealed archive's zip CRCs alone), so that `status` and `screens show`
can say which rows did not arrive the ordinary way. Every existing attempt had its rows
written directly: NULL, nothing to backfill.

Revision ID: 0008_reconciled
Revises: 0007_screen_resources
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008_reconciled"
down_revision: str | Sequence[str] | None = "0007_screen_resources"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("attempts", recreate="never") as batch:
        batch.add_column(sa.Column("reconciled_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("reconciled_episodes", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("reconciled_check", sa.String(length=16), nullable=True))


def downgrade() -> None:
    # The rows themselves stay: only the note of how they arrived is lost.
    with op.batch_alter_table("attempts", recreate="never") as batch:
        batch.drop_column("reconciled_check")
        batch.drop_column("reconciled_episodes")
        batch.drop_column("reconciled_at")
