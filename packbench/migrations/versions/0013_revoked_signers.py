"""Revoked signers: a signing key can be revoked (`packbench keys revoke`), never deleted.

Why: a user who lost a private key, or stops trusting a lab, had no way to say so: the key
stayed trusted by `packbench ingest` and usable by the dispatcher. `signers.revoked_at` (NULL: in
force) records when it was revoked; the row stays, so screens it signed keep naming their signer
and are shown as signed by a revoked key. A plain nullable ADD COLUMN.

Going down refuses while any key is revoked: the older revision cannot say so, and the key would
be trusted again without a word. Delete those keys by hand (`DELETE FROM signers WHERE revoked_at
IS NOT NULL`; their screens then read "not registered here") if that is acceptable, then go down.

Revision ID: 0013_revoked_signers
Revises: 0012_unhashed_audits
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013_revoked_signers"
down_revision: str | Sequence[str] | None = "0012_unhashed_audits"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("signers", recreate="never") as batch:
        batch.add_column(sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    revoked = op.get_bind().execute(sa.text("SELECT count(*) FROM signers WHERE revoked_at IS NOT NULL")).scalar()
    if revoked:
        raise RuntimeError(
            f"{revoked} revoked signing key(s), which revision 0012_unhashed_audits cannot mark revoked: going "
            f"down would trust them again; delete them (DELETE FROM signers WHERE revoked_at IS NOT NULL) if that "
            f"is acceptable, then go down again")
    with op.batch_alter_table("signers") as batch:
        batch.drop_column("revoked_at")
