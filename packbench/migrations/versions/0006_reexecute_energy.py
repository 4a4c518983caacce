"""Re-execution audits and energy per episode.

Why: issue 10 adds re-execution audits (`packbench audit SCREEN --reexecute K`): a GPU worker
re-runs episodes drawn from an archive and compares them with what the archive says; the
result is an audit row of the new kind `reexecute` (the CHECK on audits.kind widens). Issue 14
brings each episode's NVML energy (already in every archived record) into the database so
`results` and `compare` can filter and sort by it: episodes gain a nullable `energy_j`
(NULL where NVML had no energy counter, and for episodes stored before this revision).

Both are plain changes: an ADD COLUMN on episodes, and audits' CHECK rebuilt through a batch
rebuild on SQLite (no table references audits).

Revision ID: 0006_reexecute_energy
Revises: 0005_evidence
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_reexecute_energy"
down_revision: str | Sequence[str] | None = "0005_evidence"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_KINDS = ("local", "ray")
NEW_KINDS = ("local", "ray", "reexecute")


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def _audit_kinds(kinds: tuple[str, ...]) -> None:
    with op.batch_alter_table("audits") as batch:
        batch.drop_constraint(op.f("ck_audits_kind"), type_="check")
        batch.create_check_constraint("kind", _in("kind", kinds))


def upgrade() -> None:
    with op.batch_alter_table("episodes", recreate="never") as batch:
        batch.add_column(sa.Column("energy_j", sa.Float(), nullable=True))
    _audit_kinds(NEW_KINDS)


def downgrade() -> None:
    # Re-execution audits cannot be said at the older revision: they are dropped (the archives
    # they judged are untouched; `audit --reexecute` can run again after an upgrade).
    op.execute("DELETE FROM audits WHERE kind = 'reexecute'")
    _audit_kinds(OLD_KINDS)
    with op.batch_alter_table("episodes", recreate="never") as batch:
        batch.drop_column("energy_j")
