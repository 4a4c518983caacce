"""Screen labels and sweeps: a name, a note, tags, and the sweep point each screen ran.

Why: notebooks, sweeps and history select screens by what a researcher called them rather than
by id (issue 29). A screen gains a `name` and a `note` (free text), `sweep_id` (screens queued
together by `submit --sweep` share it) and `sweep_point` (canonical JSON of the swept fields and
the values this screen's protocol took); tags are key/value pairs, one value per key and screen,
in their own table so `results --tag`, `screens list --tag` and the Python API filter on them.
Every screen stored before this revision has none of these: NULL and no tags are its true value.

Revision ID: 0010_screen_labels
Revises: 0009_episode_fidelity
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010_screen_labels"
down_revision: str | Sequence[str] | None = "0009_episode_fidelity"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("screens", recreate="never") as batch:
        batch.add_column(sa.Column("name", sa.String(length=200), nullable=True))
        batch.add_column(sa.Column("note", sa.Text(), nullable=True))
        batch.add_column(sa.Column("sweep_id", sa.String(length=32), nullable=True))
        batch.add_column(sa.Column("sweep_point", sa.Text(), nullable=True))
    op.create_index(op.f("ix_screens_name"), "screens", ["name"])
    op.create_index(op.f("ix_screens_sweep_id"), "screens", ["sweep_id"])
    op.create_table(
        "screen_tags",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("screen_id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(length=100), nullable=False),
        sa.Column("value", sa.String(length=200), nullable=False),
        sa.ForeignKeyConstraint(["screen_id"], ["screens.id"], name=op.f("fk_screen_tags_screen_id_screens")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_screen_tags")),
        sa.UniqueConstraint("screen_id", "key", name=op.f("uq_screen_tags_screen_id_key")),
    )
    op.create_index(op.f("ix_screen_tags_key_value"), "screen_tags", ["key", "value"])


def downgrade() -> None:
    # Labels are what a person typed: nothing recomputes them, so a downgrade loses them.
    op.drop_index(op.f("ix_screen_tags_key_value"), table_name="screen_tags")
    op.drop_table("screen_tags")
    op.drop_index(op.f("ix_screens_sweep_id"), table_name="screens")
    op.drop_index(op.f("ix_screens_name"), table_name="screens")
    with op.batch_alter_table("screens", recreate="never") as batch:
        batch.drop_column("sweep_point")
        batch.drop_column("sweep_id")
        batch.drop_column("note")
        batch.drop_column("name")
