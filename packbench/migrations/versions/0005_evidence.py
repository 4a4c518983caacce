"""Evidence: checkpoint digest and signer of each attempt, ingested attempts, signing keys.

Why: issue 10. What a screen measured must be pinned: attempts record the content digest of
the checkpoint the worker loaded (`model_sha256`, also in the archive's worker.json). Sealed
archives are signed with a deployment's Ed25519 key: attempts record the signer
(`signer_key_id`), and a `signers` table holds the public halves (this deployment's own, and
other labs' keys trusted for `packbench ingest`); private keys never enter the database.
Attempts that `packbench ingest` brought from another machine or lab say where from
(`ingested_from`; NULL for attempts run here). Plain ADD COLUMNs and one new table.

Revision ID: 0005_evidence
Revises: 0004_job_queue
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_evidence"
down_revision: str | Sequence[str] | None = "0004_job_queue"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "signers",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("key_id", sa.String(length=16), nullable=False),
        sa.Column("public_key", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("local", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_signers")),
        sa.UniqueConstraint("key_id", name=op.f("uq_signers_key_id")),
        sa.UniqueConstraint("public_key", name=op.f("uq_signers_public_key")),
    )
    with op.batch_alter_table("attempts", recreate="never") as batch:
        batch.add_column(sa.Column("model_sha256", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("signer_key_id", sa.String(length=16), nullable=True))
        batch.add_column(sa.Column("ingested_from", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("attempts", recreate="never") as batch:
        batch.drop_column("ingested_from")
        batch.drop_column("signer_key_id")
        batch.drop_column("model_sha256")
    op.drop_table("signers")
