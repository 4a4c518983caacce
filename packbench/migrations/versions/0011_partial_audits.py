"""Partial audits: an audit of an unfinished attempt's consistent archive says `partial`.

Why: an attempt that was interrupted, failed, lost or cancelled leaves a partial archive whose
every member may still check. `packbench audit` printed it as PARTIAL, but stored the audit as
`disagree`, so `results --json`, `screens show` and the report said the archive disagreed with
the database when nothing did. audits.result gains the value `partial` (the CHECK widens through
a batch rebuild on SQLite; no table references audits). Audits stored before this revision keep
the `disagree` they were written with: whether one was partial is in its problems, and auditing
the attempt again stores a `partial` row beside it.

Revision ID: 0011_partial_audits
Revises: 0010_screen_labels
Create Date: 2026-12-03
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0011_partial_audits"
down_revision: str | Sequence[str] | None = "0010_screen_labels"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_RESULTS = ("agree", "disagree")
NEW_RESULTS = ("agree", "disagree", "partial")


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def _audit_results(results: tuple[str, ...]) -> None:
    with op.batch_alter_table("audits") as batch:
        batch.drop_constraint(op.f("ck_audits_result"), type_="check")
        batch.create_check_constraint("result", _in("result", results))


def upgrade() -> None:
    _audit_results(NEW_RESULTS)


def downgrade() -> None:
    # The older revision cannot say `partial`; such an audit was stored as `disagree` there.
    op.execute("UPDATE audits SET result = 'disagree' WHERE result = 'partial'")
    _audit_results(OLD_RESULTS)
