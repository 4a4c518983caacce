"""Screens remember their prompt file.

Why: protocols may now take prompts from a token_file or text_file (their SHA-256 is frozen
in the protocol). The path is resolved against the protocol file at submit time, so it is
stored with the screen, as model_dir is, for the dispatcher that runs the screen later.

Revision ID: 0003_screen_prompt_file
Revises: 0002_query_filters
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003_screen_prompt_file"
down_revision: str | Sequence[str] | None = "0002_query_filters"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("screens") as batch:
        batch.add_column(sa.Column("prompt_file", sa.String(), nullable=True))


def downgrade() -> None:
    # A plain drop (SQLite >= 3.35): a batch rebuild of `screens` would fail once attempts
    # reference it with foreign keys on (see 0002).
    op.drop_column("screens", "prompt_file")
