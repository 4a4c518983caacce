"""Fidelity figures of approximate episodes (`fidelity_*`).

Why: a protocol may now name approximate conditions (low-bit resident models, issue 24), whose
logits are judged by fidelity to the reference rather than bit-identity: per episode, mean and
p99 KL(reference || condition), top-1 agreement, max |logit difference| and the first step
where its free-running tokens diverge (core/fidelity.py). `results` and `compare` filter and
show them, so episodes gain five nullable columns; every episode stored before this revision
is exact (no condition could be approximate), so NULL is its true value and nothing is backfilled.

Revision ID: 0009_episode_fidelity
Revises: 0008_reconciled
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009_episode_fidelity"
down_revision: str | Sequence[str] | None = "0008_reconciled"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = (("fidelity_mean_kl", sa.Float), ("fidelity_p99_kl", sa.Float), ("fidelity_top1", sa.Float),
           ("fidelity_max_abs_logit", sa.Float), ("fidelity_divergence_step", sa.Integer))


def upgrade() -> None:
    with op.batch_alter_table("episodes", recreate="never") as batch:
        for name, kind in COLUMNS:
            batch.add_column(sa.Column(name, kind(), nullable=True))


def downgrade() -> None:
    # The figures are recomputable from each attempt's archive (packbench audit does).
    with op.batch_alter_table("episodes", recreate="never") as batch:
        for name, _ in reversed(COLUMNS):
            batch.drop_column(name)
