"""Unhashed audits: an audit of an archive over the reader's size bound is recorded with a null SHA-256.

Why: the reader refuses a file over its size bound (docs/archive.md, "Bounds") before hashing it,
so such an audit has no archive SHA-256. audits.archive_sha256 was NOT NULL, and recording that
audit failed with a constraint error, losing the failed audit. audits.archive_sha256 becomes
nullable (a batch rebuild on SQLite; no table references audits); the audit of an over-bound
archive is stored as `disagree` with its problem line and a null SHA-256. Audits stored before
this revision all hold a SHA-256 and keep it.

Going down refuses while any audit holds a null SHA-256: the older revision cannot store one, and
inventing a hash or deleting the failed audit would lose what happened. Delete those rows by hand
(`DELETE FROM audits WHERE archive_sha256 IS NULL`) if losing them is acceptable, then go down.

Revision ID: 0012_unhashed_audits
Revises: 0011_partial_audits
Create Date: 2026-12-04
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012_unhashed_audits"
down_revision: str | Sequence[str] | None = "0011_partial_audits"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _sha_nullable(nullable: bool) -> None:
    with op.batch_alter_table("audits") as batch:
        batch.alter_column("archive_sha256", existing_type=sa.String(length=64), nullable=nullable)


def upgrade() -> None:
    _sha_nullable(True)


def downgrade() -> None:
    unhashed = op.get_bind().execute(sa.text("SELECT count(*) FROM audits WHERE archive_sha256 IS NULL")).scalar()
    if unhashed:
        raise RuntimeError(
            f"{unhashed} audit(s) of an archive over the size bound hold no SHA-256, which revision "
            f"0011_partial_audits cannot store; delete them (DELETE FROM audits WHERE archive_sha256 IS NULL) "
            f"if losing those failed audits is acceptable, then go down again")
    _sha_nullable(False)
