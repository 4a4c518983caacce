"""Query filters: protocols.model and protocols.dtype, and indexes for `packbench results`.

Why: `packbench results` filters episodes by the protocol's model and dtype, by protocol
name, gate, episode status, run time (since/until) and machine. The model and dtype live
inside protocols.canonical_json (model.path, or model.synth.shape for a synthetic model,
stored as 'synth:<shape>'), and JSON-in-SQL is spelled differently on SQLite and
PostgreSQL and cannot use a plain index, so they are copied into their own columns (the
Store fills them at insert; this revision backfills stored protocols). The indexes serve
the filters that the existing ones did not: protocols(name, model, dtype),
attempts(started_at, machine_id), episodes(status), verdicts(gate).

Edited after autogenerate: the backfill, and the downgrade drops the two columns with a
plain `op.drop_column` (SQLite >= 3.35 has ALTER TABLE ... DROP COLUMN) instead of a batch
rebuild, because rebuilding `protocols` drops a table that screens reference, which fails
with foreign keys on once any screen exists.

Revision ID: 0002_query_filters
Revises: 0001_initial
Create Date: 2026-11-29
"""

import json
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0002_query_filters"
down_revision: str | Sequence[str] | None = "0001_initial"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# A lightweight table: the revision must not import application models that change later.
_protocols = sa.table(
    "protocols",
    sa.column("id", sa.Integer()),
    sa.column("canonical_json", sa.Text()),
    sa.column("model", sa.String()),
    sa.column("dtype", sa.String()),
)


def _model_and_dtype(canonical_json: str) -> tuple[str | None, str | None]:
    """The same extraction `db.ingest.protocol_columns` makes (copied: revisions are frozen)."""
    try:
        body = json.loads(canonical_json)
    except ValueError:
        return None, None
    if not isinstance(body, dict):
        return None, None
    model = body.get("model")
    if isinstance(model, dict):
        # {"path": dir} for a checkpoint on disk, {"synth": {"shape": ...}} for a synthetic one.
        synth = model.get("synth")
        model = f"synth:{synth.get('shape')}" if isinstance(synth, dict) else model.get("path")
    dtype = body.get("dtype")
    return (model if isinstance(model, str) else None, dtype if isinstance(dtype, str) else None)


def upgrade() -> None:
    op.add_column("protocols", sa.Column("model", sa.String(), nullable=True))
    op.add_column("protocols", sa.Column("dtype", sa.String(length=16), nullable=True))
    op.create_index(op.f("ix_protocols_name"), "protocols", ["name"])
    op.create_index(op.f("ix_protocols_model"), "protocols", ["model"])
    op.create_index(op.f("ix_protocols_dtype"), "protocols", ["dtype"])
    op.create_index(op.f("ix_attempts_machine_id"), "attempts", ["machine_id"])
    op.create_index(op.f("ix_attempts_started_at"), "attempts", ["started_at"])
    op.create_index(op.f("ix_episodes_status"), "episodes", ["status"])
    op.create_index(op.f("ix_verdicts_gate"), "verdicts", ["gate"])

    # Backfill: protocols are few (one per frozen protocol), so row by row is fine.
    connection = op.get_bind()
    for protocol_id, canonical_json in connection.execute(
        sa.select(_protocols.c.id, _protocols.c.canonical_json)
    ).all():
        model, dtype = _model_and_dtype(canonical_json)
        if model is not None or dtype is not None:
            connection.execute(
                _protocols.update()
                .where(_protocols.c.id == protocol_id)
                .values(model=model, dtype=dtype)
            )


def downgrade() -> None:
    op.drop_index(op.f("ix_verdicts_gate"), table_name="verdicts")
    op.drop_index(op.f("ix_episodes_status"), table_name="episodes")
    op.drop_index(op.f("ix_attempts_started_at"), table_name="attempts")
    op.drop_index(op.f("ix_attempts_machine_id"), table_name="attempts")
    op.drop_index(op.f("ix_protocols_dtype"), table_name="protocols")
    op.drop_index(op.f("ix_protocols_model"), table_name="protocols")
    op.drop_index(op.f("ix_protocols_name"), table_name="protocols")
    # Not batch mode on SQLite: see the docstring. The values are copies of canonical_json,
    # so nothing is lost.
    op.drop_column("protocols", "dtype")
    op.drop_column("protocols", "model")
