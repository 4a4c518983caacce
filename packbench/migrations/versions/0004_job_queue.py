"""Job queue: priorities, leases, attempt keys, dispatchers, placement, audit node and kind.

Why: issue 12 turns the screens table into a durable queue that several dispatchers claim
from atomically. A claim is a lease (attempts.lease_expires_at) that the dispatcher renews; an
expired one makes the attempt `lost` and requeues the screen up to screens.max_attempts
(screens.attempts_used counts the claims). Screens gain priority (FIFO within one), the
placement fields a dispatcher filters on (gpu_type, placement_node, exclusive_node,
replica_group), the reason nobody can place them (unplaceable_reason) and a cancel request.
Attempts gain the new statuses `lost` and `cancelled`, a random attempt_key (archive file
names unique across databases and machines; stored attempts are backfilled), the dispatcher
that ran them, whether the model was cold or warm and whether the node was shared. A
dispatchers table holds heartbeats and workers for `packbench status`. attempts(node, status)
is indexed for claims made for a worker slot on a node. Audits record the
node they ran on and their kind (local or ray).

Edited after autogenerate. On SQLite the attempts table is rebuilt by hand to change its
CHECK constraint: Alembic's batch mode drops and renames the table, and dropping a table
that episodes, verdicts and audits reference fails with foreign keys on (see 0002). Here,
inside the migration's transaction, `PRAGMA defer_foreign_keys` defers the checks to
commit; the old rows are copied to a temporary table, the table is dropped (its children
become violations, counted), re-created under the same name from a copy of its definition
at this revision, and refilled, which resolves every counted violation before commit. The
screens and audits columns are plain ADD COLUMNs (audits' CHECK through a batch rebuild: no
table references audits).

Revision ID: 0004_job_queue
Revises: 0003_screen_prompt_file
Create Date: 2026-11-30
"""

import secrets
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.schema import CreateIndex, CreateTable

revision: str = "0004_job_queue"
down_revision: str | Sequence[str] | None = "0003_screen_prompt_file"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_STATUSES = ("running", "done", "failed", "interrupted")
NEW_STATUSES = ("running", "done", "failed", "interrupted", "lost", "cancelled")
NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
OLD_COLUMNS = ("id", "screen_id", "number", "worker", "node", "gpu_name", "gpu_index", "machine_id",
               "status", "error", "archive_path", "archive_sha256", "source_freeze", "started_at",
               "finished_at")


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def _attempts_table(queue: bool) -> sa.Table:
    """The attempts table as this revision (queue=True) or the previous one leaves it, for
    the SQLite rebuild. A copy, not the application model: revisions are frozen."""
    metadata = sa.MetaData(naming_convention=NAMING)
    sa.Table("screens", metadata, sa.Column("id", sa.Integer(), primary_key=True))
    sa.Table("machines", metadata, sa.Column("id", sa.Integer(), primary_key=True))
    sa.Table("dispatchers", metadata, sa.Column("id", sa.Integer(), primary_key=True))
    columns = [
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("screen_id", sa.Integer(), sa.ForeignKey("screens.id"), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(), nullable=False),
        sa.Column("node", sa.String(), nullable=False),
        sa.Column("gpu_name", sa.String(), nullable=False),
        sa.Column("gpu_index", sa.Integer(), nullable=False),
        sa.Column("machine_id", sa.Integer(), sa.ForeignKey("machines.id"), nullable=True, index=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("archive_path", sa.String(), nullable=False),
        sa.Column("archive_sha256", sa.String(length=64), nullable=True),
        sa.Column("source_freeze", sa.Text(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False, index=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.UniqueConstraint("screen_id", "number"),
        sa.CheckConstraint(_in("status", NEW_STATUSES if queue else OLD_STATUSES), name="status"),
    ]
    if queue:
        columns += [
            sa.Column("attempt_key", sa.String(length=32), nullable=True, unique=True),
            sa.Column("dispatcher_id", sa.Integer(), sa.ForeignKey("dispatchers.id"), nullable=True),
            sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True, index=True),
            sa.Column("model_state", sa.String(length=8), nullable=True),
            sa.Column("shared_node", sa.Boolean(), nullable=True),
            sa.CheckConstraint(_in("model_state", ("cold", "warm")), name="model_state"),
            sa.Index("ix_attempts_node_status", "node", "status"),
        ]
    return sa.Table("attempts", metadata, *columns)


def _rebuild_sqlite_attempts(queue: bool) -> None:
    """Re-create attempts with the definition of `queue`, keeping its rows (see the docstring)."""
    bind = op.get_bind()
    table = _attempts_table(queue)
    bind.exec_driver_sql("PRAGMA defer_foreign_keys = ON")  # reset by SQLite at commit
    bind.exec_driver_sql("DROP TABLE IF EXISTS temp._pb_attempts_copy")
    bind.exec_driver_sql("CREATE TEMP TABLE _pb_attempts_copy AS SELECT * FROM attempts")
    bind.exec_driver_sql("DROP TABLE attempts")
    bind.execute(CreateTable(table))
    for index in table.indexes:
        bind.execute(CreateIndex(index))
    names = ", ".join(OLD_COLUMNS)
    bind.exec_driver_sql(f"INSERT INTO attempts ({names}) SELECT {names} FROM _pb_attempts_copy")
    bind.exec_driver_sql("DROP TABLE temp._pb_attempts_copy")


def upgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    op.create_table(
        "dispatchers",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("host", sa.String(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("stopped_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("workers_json", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_dispatchers")),
    )
    op.add_column("screens", sa.Column("priority", sa.Integer(), server_default="0", nullable=False))
    op.add_column("screens", sa.Column("max_attempts", sa.Integer(), server_default="3", nullable=False))
    op.add_column("screens", sa.Column("attempts_used", sa.Integer(), server_default="0", nullable=False))
    op.add_column("screens", sa.Column("gpu_type", sa.String(), nullable=True))
    op.add_column("screens", sa.Column("placement_node", sa.String(), nullable=True))
    op.add_column("screens", sa.Column("exclusive_node", sa.Boolean(), server_default=sa.false(), nullable=False))
    op.add_column("screens", sa.Column("replica_group", sa.String(length=32), nullable=True))
    op.add_column("screens", sa.Column("unplaceable_reason", sa.Text(), nullable=True))
    op.add_column("screens", sa.Column("cancel_requested_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index(op.f("ix_screens_replica_group"), "screens", ["replica_group"])

    if sqlite:
        _rebuild_sqlite_attempts(queue=True)
    else:
        op.drop_constraint(op.f("ck_attempts_status"), "attempts", type_="check")
        op.create_check_constraint(op.f("ck_attempts_status"), "attempts", _in("status", NEW_STATUSES))
        op.add_column("attempts", sa.Column("attempt_key", sa.String(length=32), nullable=True))
        op.add_column("attempts", sa.Column("dispatcher_id", sa.Integer(), nullable=True))
        op.add_column("attempts", sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True))
        op.add_column("attempts", sa.Column("model_state", sa.String(length=8), nullable=True))
        op.add_column("attempts", sa.Column("shared_node", sa.Boolean(), nullable=True))
        op.create_unique_constraint(op.f("uq_attempts_attempt_key"), "attempts", ["attempt_key"])
        op.create_foreign_key(op.f("fk_attempts_dispatcher_id_dispatchers"), "attempts", "dispatchers",
                              ["dispatcher_id"], ["id"])
        op.create_index(op.f("ix_attempts_lease_expires_at"), "attempts", ["lease_expires_at"])
        op.create_index(op.f("ix_attempts_node_status"), "attempts", ["node", "status"])
        op.create_check_constraint(op.f("ck_attempts_model_state"), "attempts",
                                   _in("model_state", ("cold", "warm")))

    # Backfill: every stored attempt gets its key (attempts are few: one per screen run).
    attempts = sa.table("attempts", sa.column("id", sa.Integer()), sa.column("attempt_key", sa.String()))
    connection = op.get_bind()
    for (attempt_id,) in connection.execute(sa.select(attempts.c.id)).all():
        connection.execute(attempts.update().where(attempts.c.id == attempt_id)
                           .values(attempt_key=secrets.token_hex(16)))

    with op.batch_alter_table("audits") as batch:
        batch.add_column(sa.Column("node", sa.String(), nullable=True))
        batch.add_column(sa.Column("kind", sa.String(length=16), nullable=True))
        batch.create_check_constraint("kind", _in("kind", ("local", "ray")))


def downgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    with op.batch_alter_table("audits") as batch:
        batch.drop_constraint(op.f("ck_audits_kind"), type_="check")
        batch.drop_column("kind")
        batch.drop_column("node")
    # The old statuses cannot say lost or cancelled: both were interruptions.
    op.execute("UPDATE attempts SET status = 'interrupted' WHERE status IN ('lost', 'cancelled')")
    if sqlite:
        _rebuild_sqlite_attempts(queue=False)
    else:
        op.drop_constraint(op.f("ck_attempts_model_state"), "attempts", type_="check")
        op.drop_index(op.f("ix_attempts_node_status"), table_name="attempts")
        op.drop_index(op.f("ix_attempts_lease_expires_at"), table_name="attempts")
        op.drop_constraint(op.f("fk_attempts_dispatcher_id_dispatchers"), "attempts", type_="foreignkey")
        op.drop_constraint(op.f("uq_attempts_attempt_key"), "attempts", type_="unique")
        for column in ("shared_node", "model_state", "lease_expires_at", "dispatcher_id", "attempt_key"):
            op.drop_column("attempts", column)
        op.drop_constraint(op.f("ck_attempts_status"), "attempts", type_="check")
        op.create_check_constraint(op.f("ck_attempts_status"), "attempts", _in("status", OLD_STATUSES))
    op.drop_index(op.f("ix_screens_replica_group"), table_name="screens")
    # Plain drops (SQLite >= 3.35), not a batch rebuild of a referenced table (see 0002). Queued
    # screens lose their priority and placement; screens themselves are kept.
    for column in ("cancel_requested_at", "unplaceable_reason", "replica_group", "exclusive_node",
                   "gpu_type", "placement_node", "attempts_used", "max_attempts", "priority"):
        op.drop_column("screens", column)
    op.drop_table("dispatchers")
