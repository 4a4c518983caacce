"""`Store`: every read and write packbench makes to its database.

Contract
- Each public method is one transaction (`session_scope`) and returns plain data: ids or
  frozen dataclasses from `db.records`, never ORM objects.
- Database failures raise `DatabaseError` (one line: cause and fix). A missing screen,
  attempt or protocol raises `NotFound`; a request that would overwrite history raises
  `Conflict`.
- Data methods refuse a database whose schema is not at head (`SchemaNotAtHead`, naming
  `packbench db upgrade`); the check runs once per `Store`. The schema methods (`upgrade`,
  `current`, `history`, `head`, `check_head`) work on any database.
- Writes that workers may repeat (episodes, verdicts, protocols, machines) are idempotent
  upserts on their natural key, safe under concurrent writers on both backends.
- The Store owns the transaction and the retries; the connections it holds between calls
  for episodes and claims are `db.connections.HeldConnections`, the schema's refusals
  `db.migrate.not_at_head`. The statements live by topic: the job queue (claims, leases, reaping, cancellation, dispatchers) in
  `db.queue`, writes of results and ingests in `db.ingest`, the CLI's reads in `db.queries`
  (`results`, `list_screens`, `screen_detail`), `db.compare` and `db.status`.
- Time is the Store's clock (`clock`, default the caller's UTC clock), used for every lease,
  heartbeat and timestamp: dispatchers on several machines need synchronised clocks (NTP),
  and a lease should be much longer than their skew (leases of tens of seconds).
- The dispatcher's writes (`@retried`, `db.retry`) survive a brief database outage.
  `dispatch --follow` then waits with `ping` (one try each) and, once it answers, inserts
  the rows its archives hold (`reconcile_targets`, `put_reconciled`: service/reconcile.py).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, select, text
from sqlalchemy.orm import Session

from packbench.db import compare as compare_query, history, ingest, labels, migrate, queries, queue, status as status_query
from packbench.db.history import HistoryRun
from packbench.db.compare import ScreenComparison
from packbench.db.connections import HeldConnections
from packbench.db.errors import NotFound, SchemaNotAtHead
from packbench.db.ingest import EPISODE_KEY, RECONCILE_CHECKS, VERDICT_KEY
from packbench.db.models import AUDIT_KINDS, SqlAttempt, SqlAudit, SqlEpisode, SqlMachine, SqlProtocol, SqlSigner, SqlVerdict, \
    json_text, utcnow
from packbench.db.queries import ResultFilter, ResultRow, ScreenDetail, ScreenSummary, get_row
from packbench.db.queue import new_attempt_key
from packbench.db.records import (
    AttemptRow,
    AuditRow,
    Claim,
    DispatcherRow,
    EpisodeRow,
    MachineRow,
    ProtocolRow,
    Reaped,
    ReconcileTarget,
    ScreenRow,
    SignerRow,
    StoredVerdict,
)
from packbench.db.retry import RETRY_DELAYS_S, retried
from packbench.db.session import ENV_VAR, display_url, make_engine, session_scope, translate_errors, upgrade_command
from packbench.db.status import QueueStatus


class Store:
    """The packbench database at `url` (default: `db.session.default_url()`); `setting` names
    where the URL came from in its refusals (`--db`, the variable).

    Creating a Store does not connect; the first method call does. Call `close()` (or use
    it as a context manager) to release pooled connections.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        setting: str = ENV_VAR,
        clock: Callable[[], datetime] = utcnow,
        retry_delays: Sequence[float] = RETRY_DELAYS_S,
    ) -> None:
        self._engine: Engine = make_engine(url, setting=setting)
        self._setting = setting  # how the caller gave `url`, as a refusal names the fix
        self._schema_checked = False
        # The one time source for leases, heartbeats and timestamps (tests pass a fake one).
        self._clock = clock
        self._retry_delays = tuple(retry_delays)
        self._protocols: dict[int, ProtocolRow] = {}
        # The episode writer's and the claimer's connections, held between calls (db.connections).
        self._held = HeldConnections(self._engine, setting=setting)

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The database URL with any password hidden (safe to print)."""
        return display_url(self._engine.url)

    @property
    def dialect(self) -> str:
        """'sqlite' or 'postgresql'."""
        return self._engine.dialect.name

    def close(self) -> None:
        self._held.drop()
        self._engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- schema ------------------------------------------------------------------------

    def upgrade(self, revision: str = "head") -> str | None:
        """Migrate the schema to `revision` (default: head) in one transaction; the revision it
        found (None: no schema), read under the migration lock, so after any migration that ran
        at the same time."""
        with self._connection() as connection:
            migrate.lock_migrations(connection)  # one migration of a schema at a time
            current = migrate.current(connection)
            if current is not None and current not in migrate.known_revisions():
                raise SchemaNotAtHead(migrate.unknown_revision(self.url, current))
            migrate.upgrade(connection, revision)
        self._schema_checked = False
        return current

    def downgrade(self, revision: str) -> None:
        """Migrate the schema down to `revision` ('base' drops every table). For developers."""
        with self._connection() as connection:
            migrate.lock_migrations(connection)
            migrate.downgrade(connection, revision)
        self._schema_checked = False

    def current(self) -> str | None:
        """The revision the database is at, or None if it has no packbench schema."""
        with self._connection() as connection:
            return migrate.current(connection)

    @staticmethod
    def history() -> list[str]:
        """Shipped revisions, newest first, as 'revision: first docstring line'."""
        return migrate.history()

    @staticmethod
    def head() -> str:
        """The revision this packbench needs."""
        return migrate.head()

    @staticmethod
    def knows(revision: str) -> bool:
        """Whether `revision` is one of this packbench's migrations (else a newer packbench wrote it)."""
        return revision in migrate.known_revisions()

    def check_head(self) -> None:
        """Raise `SchemaNotAtHead` unless the database is at `head()`; an empty one is not."""
        refusal = migrate.not_at_head(self.url, self.current(), upgrade=upgrade_command(self.url, setting=self._setting))
        if refusal is not None:
            raise SchemaNotAtHead(refusal)
        self._schema_checked = True

    # -- protocols and machines --------------------------------------------------------

    @retried
    def put_protocol(self, *, sha256: str, name: str, canonical_json: str) -> int:
        """Store a frozen protocol; return its id. Idempotent on `sha256`.

        The model and dtype are copied from `canonical_json` into their own columns for the
        query filters (see `db.ingest.protocol_columns`; None where the JSON lacks them).
        """
        with self._session() as session:
            return ingest.upsert_protocol(session, sha256=sha256, name=name, canonical_json=canonical_json,
                                          now=self._clock())

    def protocol(self, protocol_id: int) -> ProtocolRow:
        with self._session() as session:
            return get_row(session, SqlProtocol, protocol_id, "protocol").to_record()

    @retried
    def put_machine(self, *, host: str | None, gpu_name: str | None, driver: str | None, torch: str | None,
                    cuda: str | None) -> int:
        """Store a machine fingerprint; return its id. Idempotent; None and '' are the same."""
        key = {"host": host or "", "gpu_name": gpu_name or "", "driver": driver or "",
               "torch": torch or "", "cuda": cuda or ""}
        with self._session() as session:
            return ingest.upsert_machine(session, key)

    def machine(self, machine_id: int) -> MachineRow:
        with self._session() as session:
            return get_row(session, SqlMachine, machine_id, "machine").to_record()

    # -- screens -----------------------------------------------------------------------

    @retried
    def create_screen(
        self,
        *,
        protocol_id: int,
        submitter: str,
        repetitions: int = 1,
        model_dir: str | None = None,
        prompt_file: str | None = None,
        priority: int = 0,
        max_attempts: int = 3,
        gpu_type: str | None = None,
        placement_node: str | None = None,
        exclusive_node: bool = False,
        replica_group: str | None = None,
        resources: Mapping[str, float] | None = None,
    ) -> int:
        """Queue a new screen of a stored protocol; return its id.

        `model_dir` is the checkpoint directory resolved at submit time, kept so that every
        attempt loads the same one (None for a synthetic model, generated on the worker);
        `prompt_file` likewise for a token_file/text_file prompt source.
        Queue options: `priority` (higher is claimed first; FIFO within one), `max_attempts`
        (claims allowed before a screen whose leases keep expiring is failed, >= 1),
        `gpu_type` (only a worker of that GPU type may claim it), `placement_node` (only a
        worker on that node), `exclusive_node` (no other screen runs on its node meanwhile),
        `replica_group` (screens sharing one, e.g. from `create_screens(spread=True)`, run on distinct nodes),
        `resources` (custom Ray resources its node must have free: only a claim whose
        `node_resources` cover them, beside what runs there already, can take it).
        """
        if max_attempts < 1:
            raise ValueError(f"max_attempts {max_attempts} must be >= 1")
        with self._session() as session:
            return queue.enqueue(
                session, clock=self._clock, protocol_id=protocol_id, submitter=submitter, repetitions=repetitions,
                model_dir=model_dir, prompt_file=prompt_file, priority=priority, max_attempts=max_attempts,
                gpu_type=gpu_type, placement_node=placement_node, exclusive_node=exclusive_node,
                replica_group=replica_group, resources=resources)[0]

    def create_screens(self, count: int, *, spread: bool = False, name: str | None = None, note: str | None = None,
                       tags: Mapping[str, str] | None = None, **screen: Any) -> list[int]:
        """Queue `count` screens of one protocol (`create_screen`'s arguments), labelled with
        `name`, `note` and `tags` when given, in one transaction: all of them or none (an error
        or an interrupt part-way queues nothing). `spread`: they share a new random
        replica_group, so that they run on distinct nodes (`submit --replicas N --spread`).
        Return their ids."""
        if count < 1:
            raise ValueError(f"count {count} must be >= 1")
        if screen.get("max_attempts", 1) < 1:
            raise ValueError(f"max_attempts {screen['max_attempts']} must be >= 1")
        with self._session() as session:
            if spread:
                screen["replica_group"] = new_attempt_key()
            ids = queue.enqueue(session, clock=self._clock, count=count, **screen)
            if name is not None or note is not None or tags:
                for screen_id in ids:
                    labels.label(session, screen_id, name=name, note=note, tags=tags)
            return ids

    def create_sweep(self, sweep_id: str, points: Sequence[tuple[Mapping[str, str], Mapping[str, Any],
                                                                Mapping[str, Any]]], *,
                     name: str | None = None, note: str | None = None,
                     tags: Mapping[str, str] | None = None) -> list[int]:
        """Store each point's frozen protocol (`put_protocol`'s sha256, name, canonical_json) and
        queue one screen of it (`create_screen`'s columns), labelled and recorded as the point
        `values` of `sweep_id`, all in one transaction: every point or none (an error or an
        interrupt part-way queues nothing). `points`: (protocol, screen, values) in grid order.
        Return the screen ids in that order."""
        ids = []
        with self._session() as session:
            for protocol, screen, values in points:
                protocol_id = ingest.upsert_protocol(session, now=self._clock(), **protocol)
                (screen_id,) = queue.enqueue(session, clock=self._clock, protocol_id=protocol_id, **screen)
                if name is not None or note is not None or tags:
                    labels.label(session, screen_id, name=name, note=note, tags=tags)
                labels.set_sweep(session, screen_id, sweep_id=sweep_id, point=values)
                ids.append(screen_id)
        return ids

    def queued_screens(self) -> list[ScreenRow]:
        """Screens waiting for a worker in claim order: highest priority, then oldest."""
        with self._session() as session:
            return queue.queued_screens(session)

    def screen(self, ref: int | str) -> ScreenRow:
        """The screen with id `ref` (an int or a string of digits), or 'latest' (highest id)."""
        with self._session() as session:
            return queries.find_screen(session, ref).to_record()

    # -- attempts ----------------------------------------------------------------------

    @retried
    def start_attempt(self, *, screen_id: int, worker: str, node: str, gpu_name: str, gpu_index: int,
                      machine_id: int | None, source_freeze: dict[str, Any], archive_path: str) -> AttemptRow:
        """Record that a worker starts on a screen; return the new running attempt.

        Its number is 1 + the highest existing number for the screen (earlier attempts,
        failed ones included, are kept). The screen becomes 'running'; its started_at is
        set on the first attempt only.
        """
        with self._session() as session:
            return queue.start_attempt(session, clock=self._clock, screen_id=screen_id, worker=worker, node=node,
                                       gpu_name=gpu_name, gpu_index=gpu_index, machine_id=machine_id,
                                       source_freeze=source_freeze, archive_path=archive_path)

    @retried
    def finish_attempt(self, attempt_id: int, *, status: str, error: str | None = None,
                       archive_sha256: str | None = None, requeue: bool = False) -> str:
        """Close a running attempt as 'done', 'failed', 'interrupted' or 'cancelled'; return the screen's status
        after it (`db.queue.finish_attempt`)."""
        queue.check_final_status(status)
        with self._session() as session:
            return queue.finish_attempt(session, attempt_id, clock=self._clock, status=status, error=error,
                                        archive_sha256=archive_sha256, requeue=requeue)

    def attempts(self, screen_id: int) -> list[AttemptRow]:
        """The screen's attempts, by number."""
        with self._session() as session:
            query = select(SqlAttempt).where(SqlAttempt.screen_id == screen_id).order_by(SqlAttempt.number)
            return [attempt.to_record() for attempt in session.scalars(query)]

    def latest_attempt(self, screen_id: int) -> AttemptRow | None:
        """The screen's highest-numbered attempt, or None if it never started."""
        with self._session() as session:
            query = (
                select(SqlAttempt)
                .where(SqlAttempt.screen_id == screen_id)
                .order_by(SqlAttempt.number.desc())
                .limit(1)
            )
            attempt = session.scalars(query).first()
            return attempt.to_record() if attempt is not None else None

    # -- the job queue (db.queue) ------------------------------------------------------

    @retried
    def register_dispatcher(self, name: str, host: str, *, pid: int | None = None) -> int:
        """Record a dispatcher starting; return its id (heartbeat it, stop it with `stop_dispatcher`)."""
        with self._session() as session:
            return queue.register_dispatcher(session, name, host, pid=pid, clock=self._clock)

    @retried
    def heartbeat(self, dispatcher_id: int, workers: Sequence[Mapping[str, Any]]) -> None:
        """The dispatcher is alive; `workers` replaces its workers as `packbench status` shows
        them: each {name, node, gpu, gpu_index, state: idle|busy, screen_id (busy only)}."""
        listed = queue.worker_list(workers)
        with self._session() as session:
            queue.heartbeat(session, dispatcher_id, listed, clock=self._clock)

    @retried
    def stop_dispatcher(self, dispatcher_id: int) -> None:
        """The dispatcher shut down cleanly (release its attempts first): no longer listed as live."""
        with self._session() as session:
            queue.stop_dispatcher(session, dispatcher_id, clock=self._clock)

    def dispatchers(self) -> list[DispatcherRow]:
        """Every dispatcher ever registered, by id."""
        with self._session() as session:
            return queue.dispatchers(session)

    @retried
    def claim_screen(self, dispatcher_id: int, *, lease_s: float, archive_dir: str, source_freeze: Mapping[str, Any],
                     worker: str = "", node: str = "", gpu_name: str = "", gpu_index: int = -1,
                     machine_id: int | None = None, gpu_types: Collection[str] | None = None,
                     exclude_screens: Collection[int] = (), screen_id: int | None = None,
                     model_state: str | None = None, node_resources: Mapping[str, float] | None = None,
                     follows_attempt: int | None = None) -> Claim | None:
        """Atomically claim the best queued screen this worker slot can run; None if there is none.
        `db.queue.claim_request` says which screens are placeable and what a claim writes."""
        request = queue.claim_request(
            dispatcher_id, clock=self._clock, lease_s=lease_s, archive_dir=archive_dir, source_freeze=source_freeze,
            worker=worker, node=node, gpu_name=gpu_name, gpu_index=gpu_index, machine_id=machine_id,
            gpu_types=gpu_types, exclude_screens=exclude_screens, screen_id=screen_id, model_state=model_state,
            node_resources=node_resources, follows_attempt=follows_attempt)
        self._require_head()
        claimed = self._held.claim(request)
        if claimed is None:
            return None
        screen, attempt = claimed
        return Claim(screen=screen, attempt=attempt, protocol=self._protocol_row(screen.protocol_id))

    def _protocol_row(self, protocol_id: int) -> ProtocolRow:
        """A protocol, cached: frozen protocols never change."""
        row = self._protocols.get(protocol_id)
        if row is None:
            row = self._protocols[protocol_id] = self.protocol(protocol_id)
        return row

    @retried
    def place_attempt(self, attempt_id: int, *, worker: str | None = None, node: str | None = None,
                      gpu_name: str | None = None, gpu_index: int | None = None, machine_id: int | None = None,
                      model_state: str | None = None) -> AttemptRow:
        """Record where a claimed attempt runs, once the dispatcher knows (arguments left None
        are kept). A node given marks it and the other attempts running there shared_node.
        `Conflict` if the attempt is no longer running."""
        queue.check_model_state(model_state)
        placement = dict(worker=worker, node=node, gpu_name=gpu_name, gpu_index=gpu_index, machine_id=machine_id,
                         model_state=model_state)
        with self._session() as session:
            return queue.place_attempt(session, attempt_id, placement)

    @retried
    def renew_lease(self, attempt_id: int, lease_s: float) -> bool:
        """Extend a running attempt's lease to now + `lease_s`; False: stop after the episode in flight
        (`db.queue.renew_lease`)."""
        queue.check_lease(lease_s)
        with self._session() as session:
            return queue.renew_lease(session, attempt_id, lease_s, clock=self._clock)

    @retried
    def reap_expired(self, now: datetime | None = None, *, host: str | None = None,
                     alive: Callable[[int, datetime], bool] | None = None) -> list[Reaped]:
        """Turn running attempts whose lease expired before `now` (default: the clock) into `lost` ones;
        with `host` and `alive`, those of a dispatcher on `host` by whether its process lives
        (`db.queue.reap_expired`)."""
        with self._session() as session:
            return queue.reap_expired(session, now, clock=self._clock, host=host, alive=alive)

    @retried
    def release(self, attempt_id: int, reason: str) -> str:
        """A dispatcher shutting down cleanly gives a running attempt back; return the screen's new status
        (`db.queue.release`)."""
        with self._session() as session:
            return queue.release(session, attempt_id, reason, clock=self._clock)

    @retried
    def cancel_screen(self, ref: int | str) -> ScreenRow:
        """Cancel a screen (id or 'latest'); return it as it now is (`db.queue.cancel_screen`)."""
        with self._session() as session:
            return queue.cancel_screen(session, ref, clock=self._clock)

    @retried
    def retry_screen(self, ref: int | str) -> ScreenRow:
        """Queue a failed or cancelled screen (id or 'latest') again with a fresh attempt budget
        (`db.queue.retry_screen`)."""
        with self._session() as session:
            return queue.retry_screen(session, ref)

    @retried
    def set_unplaceable(self, screen_id: int, reason: str | None) -> bool:
        """Say why no dispatcher can place a queued screen now (None clears it); it stays
        queued and `packbench status` shows the reason. False if it is no longer queued."""
        with self._session() as session:
            return queue.set_unplaceable(session, screen_id, reason)

    def replica_nodes(self, replica_group: str) -> set[str]:
        """Nodes where screens of `replica_group` run or ran to completion."""
        with self._session() as session:
            return queue.replica_nodes(session, replica_group)

    def queue_status(self, *, live_within_s: float = 30.0) -> QueueStatus:
        """`packbench status`: screens per state, running screens with progress and placement,
        the queue in claim order with unplaceable reasons, dispatchers (live: a heartbeat
        within `live_within_s`) and their workers."""
        with self._session() as session:
            return status_query.queue_status(session, now=self._clock(), live_within_s=live_within_s)

    # -- episodes and verdicts (db.ingest) ---------------------------------------------

    @retried
    def put_episode(self, attempt_id: int, record: Mapping[str, Any]) -> bool:
        """Store one episode record as a worker sent it; True if new, False if already stored.

        Idempotent on (attempt_id, plan_index): a re-sent record changes nothing (the first
        copy wins). Required keys: plan_index, condition, role, prompt, status. Everything
        else may be missing (a failed episode): counters become 0, peaks None, tokens [].
        Keys not stored (e.g. 'calls') are ignored; the raw archive keeps them.
        One transaction per record, on a connection the Store holds between records
        (`db.ingest.insert_episode_sqlite` says why SQLite's bypasses SQLAlchemy).
        """
        row = ingest.episode_columns(attempt_id, record)
        self._require_head()
        return self._held.insert_episode(row)

    @retried
    def put_episodes(self, attempt_id: int, records: Iterable[Mapping[str, Any]]) -> int:
        """Store many episode records in ONE transaction; return how many were new.

        Same idempotence as `put_episode` (a stored or repeated plan_index is skipped). For
        bulk loads (imports, benchmarks): a worker streaming results calls `put_episode`, so
        each record is durable the moment it is acknowledged.
        """
        rows = [ingest.episode_columns(attempt_id, record) for record in records]
        if not rows:
            return 0
        with self._session() as session:
            return ingest.insert_ignore(session, SqlEpisode, rows, EPISODE_KEY)

    def ping(self) -> None:
        """One round trip (`SELECT 1`), tried once: raises `DatabaseUnavailable` while the
        database is down (what `dispatch --follow` probes with while it waits)."""
        with self._session() as session:
            session.execute(select(1))

    @retried
    def reconcile_targets(self, *, attempt_ids: Collection[int] | None = None, finished_since: datetime | None = None,
                          host: str | None = None, alive: Callable[[int, datetime], bool] | None = None
                          ) -> list[ReconcileTarget]:
        """Attempts whose archive may hold episodes without a row, with the plan indexes
        stored for each: `attempt_ids` (running ones included), or every attempt that is not
        running (its dispatcher writes it, and reconciles its own when the database is back),
        only those finished at or after `finished_since` when given; with `host` and
        `alive(pid, started_at)`, also the running attempts of a dispatcher on `host` whose
        process is gone (nobody writes their archives any more)."""
        with self._session() as session:
            return ingest.reconcile_targets(session, attempt_ids=attempt_ids, finished_since=finished_since,
                                            host=host, alive=alive)

    @retried
    def put_reconciled(self, attempt_id: int, records: Sequence[Mapping[str, Any]], *, check: str) -> int:
        """Insert episode rows recovered from the attempt's archive, in one transaction, and
        note it on the attempt (`reconciled_at`, `reconciled_episodes`, `reconciled_check`);
        return how many were new. Idempotent: INSERT ... ON CONFLICT (attempt_id, plan_index)
        DO NOTHING, so a row that arrived meanwhile (or a second reconciler) inserts nothing."""
        if check not in RECONCILE_CHECKS:
            raise ValueError(f"check {check!r} is not one of {', '.join(RECONCILE_CHECKS)}")
        with self._session() as session:
            return ingest.put_reconciled(session, attempt_id, records, check=check, clock=self._clock)

    def episodes(self, attempt_id: int) -> list[EpisodeRow]:
        """The attempt's episodes, by plan_index."""
        with self._session() as session:
            query = select(SqlEpisode).where(SqlEpisode.attempt_id == attempt_id).order_by(SqlEpisode.plan_index)
            return [episode.to_record() for episode in session.scalars(query)]

    @retried
    def put_verdicts(self, attempt_id: int, verdicts: list[Mapping[str, Any]]) -> int:
        """Store gate verdicts in one transaction; return how many were new.

        Idempotent on (attempt_id, gate, condition, phase): an existing verdict is kept.
        Each verdict: gate, condition, phase, passed, value, threshold, interval ([lo, hi] or
        None), episodes (plan indexes), detail.
        """
        rows = [ingest.verdict_columns(attempt_id, verdict) for verdict in verdicts]
        if not rows:
            return 0
        with self._session() as session:
            return ingest.insert_ignore(session, SqlVerdict, rows, VERDICT_KEY)

    def verdicts(self, attempt_id: int) -> list[StoredVerdict]:
        """The attempt's verdicts, ordered by (gate, condition, phase) in code-point order."""
        with self._session() as session:
            query = select(SqlVerdict).where(SqlVerdict.attempt_id == attempt_id)
            return sorted((verdict.to_record() for verdict in session.scalars(query)), key=queries.verdict_order)

    # -- audits ------------------------------------------------------------------------

    @retried
    def put_audit(self, *, attempt_id: int, archive_sha256: str | None, digest: str, result: str, problems: list[str],
                  machine: str, started_at: datetime, finished_at: datetime, node: str | None = None,
                  kind: str | None = None) -> int:
        """Append one audit run ('agree', 'disagree', or 'partial': an unfinished attempt's
        consistent archive); return its id. `archive_sha256` is None for an archive over the
        reader's size bound, never hashed. Never deduplicated:
        repeat audits are evidence in their own right. Times must be timezone-aware.
        `machine` is the host that asked for the audit, `node` the one it ran on (a Ray
        node for kind 'ray', the same host for 'local')."""
        if kind is not None and kind not in AUDIT_KINDS:
            raise ValueError(f"audit kind {kind!r} is not one of {', '.join(AUDIT_KINDS)}")
        for moment in (started_at, finished_at):
            if moment.tzinfo is None:
                raise ValueError(f"naive datetime {moment!r}: pass an aware one, e.g. datetime.now(UTC)")
        with self._session() as session:
            audit = SqlAudit(attempt_id=attempt_id, archive_sha256=archive_sha256, digest=digest, result=result,
                             problems_json=json_text(list(problems)), machine=machine, started_at=started_at,
                             finished_at=finished_at, node=node, kind=kind)
            session.add(audit)
            session.flush()
            return audit.id

    def audits(self, attempt_id: int) -> list[AuditRow]:
        """The attempt's audit runs, oldest first."""
        with self._session() as session:
            query = select(SqlAudit).where(SqlAudit.attempt_id == attempt_id).order_by(SqlAudit.id)
            return [audit.to_record() for audit in session.scalars(query)]

    # -- queries (db.queries) ------------------------------------------------------------

    def results(self, filters: ResultFilter) -> list[ResultRow]:
        """Episodes matching `filters` (see `ResultFilter`), with screen, attempt, protocol."""
        with self._session() as session:
            return queries.results(session, filters)

    def condition_tiers(self, protocol_sha256s: Iterable[str]) -> dict[str, dict[str, str]]:
        """protocol SHA-256 -> condition name -> tier (`exact` or `approximate`), from each
        stored protocol's frozen body (its conditions' policies): what `results` and `compare`
        label every row with. A condition whose policy cannot be read has no entry."""
        with self._session() as session:
            return queries.condition_tiers(session, protocol_sha256s)

    def condition_names(self) -> list[str]:
        """Every condition name of a stored episode, sorted (what `results --condition` can match)."""
        with self._session() as session:
            return queries.condition_names(session)

    def list_screens(
        self, *, status: str | None = None, protocol: str | None = None, limit: int | None = None
    ) -> list[ScreenSummary]:
        """Screens, newest first, with attempt counts and their latest attempt's verdicts."""
        with self._session() as session:
            return queries.list_screens(session, status=status, protocol=protocol, limit=limit)

    def screen_detail(self, ref: int | str) -> ScreenDetail:
        """A screen (id or 'latest') with every attempt's verdicts, audits and episode counts."""
        with self._session() as session:
            return queries.screen_detail(session, ref)

    def compare(self, ref_a: int | str, ref_b: int | str) -> ScreenComparison:
        """Per-condition scored totals and verdicts of two screens' latest attempts."""
        with self._session() as session:
            return compare_query.compare(session, ref_a, ref_b)

    def analyze(self) -> None:
        """Refresh the query planner's statistics (ANALYZE). Worth it after a bulk load;
        PostgreSQL's autovacuum does it on its own schedule otherwise."""
        with self._session() as session:
            session.execute(text("ANALYZE"))

    # -- internals ---------------------------------------------------------------------

    @contextmanager
    def _connection(self) -> Iterator[Any]:
        """A connection in a transaction, for Alembic; errors translated."""
        with translate_errors(self._engine.url, setting=self._setting), self._engine.begin() as connection:
            yield connection

    @contextmanager
    def _session(self) -> Iterator[Session]:
        """A session in a transaction, after making sure the schema is at head."""
        self._require_head()
        with session_scope(self._engine, setting=self._setting) as session:
            yield session

    def _require_head(self) -> None:
        """`check_head`, once per Store (a data method's first call)."""
        if not self._schema_checked:
            self.check_head()

    # -- evidence: signers, what an attempt measured, ingested attempts --------------

    @retried
    def put_signer(self, *, key_id: str, public_key: str, name: str, local: bool = False) -> SignerRow:
        """Register an Ed25519 public key (64 hex); idempotent on the key. Returns the stored row
        (an already registered key keeps its first name and locality)."""
        with self._session() as session:
            values = {"key_id": key_id, "public_key": public_key, "name": name, "local": local,
                      "created_at": self._clock()}
            ingest.insert_ignore(session, SqlSigner, [values], ["key_id"])
            return session.scalars(select(SqlSigner).where(SqlSigner.key_id == key_id)).one().to_record()

    @retried
    def revoke_signer(self, key_id: str) -> tuple[SignerRow, bool]:
        """Revoke the registered key `key_id` (kept, never deleted); (its row, whether this call
        revoked it: False for a key revoked before, whose first revocation time stays)."""
        with self._session() as session:
            row = session.scalars(select(SqlSigner).where(SqlSigner.key_id == key_id)).one_or_none()
            if row is None:
                raise NotFound(f"no registered signing key {key_id[:40]!r}; `packbench keys list` shows the key ids")
            revoking = row.revoked_at is None
            if revoking:
                row.revoked_at = self._clock()
            session.flush()
            return row.to_record(), revoking

    def signers(self) -> list[SignerRow]:
        with self._session() as session:
            return [row.to_record() for row in session.scalars(select(SqlSigner).order_by(SqlSigner.id))]

    @retried
    def set_attempt_evidence(self, attempt_id: int, *, model_sha256: str | None = None,
                             signer_key_id: str | None = None) -> None:
        """Record the checkpoint digest an attempt measured and/or the key that signed its archive."""
        with self._session() as session:
            attempt = get_row(session, SqlAttempt, attempt_id, "attempt")
            if model_sha256 is not None:
                attempt.model_sha256 = model_sha256
            if signer_key_id is not None:
                attempt.signer_key_id = signer_key_id

    @retried
    def ingest_attempt(self, *, protocol_sha256: str, protocol_name: str, protocol_json: str,
                       machine: Mapping[str, str | None], attempt: Mapping[str, Any],
                       episodes: list[Mapping[str, Any]], verdicts: list[Mapping[str, Any]],
                       signer: Mapping[str, str] | None = None) -> AttemptRow:
        """Record a screen audited elsewhere (`packbench ingest`) in ONE transaction: its
        protocol (idempotent), machine (idempotent), a screen and its one attempt marked with
        `ingested_from`, done (failed when every episode failed: core/outcome.py), its
        episodes and verdicts, and `signer` ({key_id, public_key, name}: the key its signature was
        checked against, when it was not registered; idempotent). Nothing is written if any part
        fails. The same archive (by SHA-256) is never ingested twice."""
        with self._session() as session:
            if signer is not None:
                ingest.insert_ignore(session, SqlSigner, [{**signer, "local": False, "created_at": self._clock()}],
                                     ["key_id"])
            return ingest.ingest_attempt(session, clock=self._clock, protocol_sha256=protocol_sha256,
                                         protocol_name=protocol_name, protocol_json=protocol_json, machine=machine,
                                         attempt=attempt, episodes=episodes, verdicts=verdicts)

    # -- labels, sweeps and history (db.labels, db.history) -----------------------------

    @staticmethod
    def check_labels(*, name: str | None = None, note: str | None = None, tags: Mapping[str, str] | None = None) -> None:
        """Refuse (InvalidFilter, one line) a name, note or tags that `label_screen` would refuse."""
        labels.check_name(name)
        labels.check_note(note)
        labels.check_tags(tags or {})

    def label_screen(self, ref: int | str, *, name: str | None = None, note: str | None = None,
                     tags: Mapping[str, str] | None = None, untag: Iterable[str] = ()) -> int:
        """Set a screen's name, note and tags (`db.labels.label`); return its id."""
        with self._session() as session:
            return labels.label(session, ref, name=name, note=note, tags=tags, untag=untag)

    def set_sweep(self, screen_id: int, *, sweep_id: str, point: Mapping[str, Any]) -> None:
        """Record the sweep a screen belongs to and the values its protocol took."""
        with self._session() as session:
            labels.set_sweep(session, screen_id, sweep_id=sweep_id, point=point)

    def screen_tags(self, screen_ids: Iterable[int]) -> dict[int, dict[str, str]]:
        """Each screen's tags."""
        with self._session() as session:
            return labels.tags_of(session, screen_ids)

    def tagged_screens(self, tags: Mapping[str, str]) -> set[int]:
        """The ids of the screens carrying every one of `tags` (a value '*' matches any)."""
        with self._session() as session:
            return labels.tagged_ids(session, tags)

    def find_screens(self, **filters: Any) -> list[ScreenRow]:
        """Screens, newest first, by protocol, status, name, tags, sweep id, ids (`db.labels.screens`)."""
        with self._session() as session:
            return labels.screens(session, **filters)

    def latest_sweep(self) -> str | None:
        """The sweep id of the newest screen in a sweep (`db.labels.latest_sweep`), or None."""
        with self._session() as session:
            return labels.latest_sweep(session)

    def history_runs(self, protocol: str) -> list[HistoryRun]:
        """A protocol's done screens with their recorded source commits (`db.history.runs`)."""
        with self._session() as session:
            return history.runs(session, protocol)
