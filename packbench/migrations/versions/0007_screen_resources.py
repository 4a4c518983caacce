"""Custom Ray resources a screen needs (`placement.resources`).

Why: a protocol may ask for custom Ray resources its node must declare, e.g. {"fast_nvme": 1}
(issue 12). The claim must filter on them atomically, in SQL, as it does on gpu_type and
placement_node; the frozen protocol body holds them too, but reading JSON inside the claim is
not portable between SQLite and PostgreSQL. So screens gain a nullable `resources`: the
canonical JSON of the needs (sorted keys), NULL for a screen that needs none, which is every
screen queued before this revision (the field did not exist, so nothing to backfill).

Revision ID: 0007_screen_resources
Revises: 0006_reexecute_energy
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007_screen_resources"
down_revision: str | Sequence[str] | None = "0006_reexecute_energy"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("screens", recreate="never") as batch:
        batch.add_column(sa.Column("resources", sa.Text(), nullable=True))


def downgrade() -> None:
    # A queued screen that needs resources loses the filter: it is failed rather than left to a
    # dispatcher that would place it anywhere.
    op.execute("UPDATE screens SET status = 'failed', unplaceable_reason = 'needs custom Ray resources, which "
               "this database revision cannot say; upgrade and retry it' WHERE status = 'queued' "
               "AND resources IS NOT NULL")
    with op.batch_alter_table("screens", recreate="never") as batch:
        batch.drop_column("resources")
