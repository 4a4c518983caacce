"""`HeldConnections`: the connections a `Store` keeps open between calls, for its two hot paths.

An episode record (`Store.put_episode`) and a claim (`Store.claim_screen`) run many times a
screen, each its own transaction: checking a connection out of the pool and resetting it on
return cost more than the insert and its commit (0.41 against 0.21 ms a record on SQLite). So
the Store holds them:

- the episode writer: on SQLite the bare driver connection (`db.ingest.insert_episode_sqlite`
  says why it bypasses SQLAlchemy), on PostgreSQL a SQLAlchemy one; only one of the two is set;
- the claimer: PostgreSQL's autocommit connection for its single-statement claims. SQLite
  claims on a pooled connection instead, whose BEGIN IMMEDIATE serializes claims.

Any error drops every held connection (the pool rolls back an open transaction as it takes
one back) and the next call opens a fresh one. Errors leave translated (`translate_errors`).
The schema check is the caller's (`Store`): nothing here reads the revision.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import PoolProxiedConnection

from packbench.db import ingest, queue
from packbench.db.records import AttemptRow, ScreenRow
from packbench.db.session import ENV_VAR, translate_errors


class HeldConnections:
    """The episode writer's and the claimer's connections to `engine`, opened on demand."""

    def __init__(self, engine: Engine, *, setting: str = ENV_VAR) -> None:
        self._engine = engine
        self._setting = setting  # where the URL came from, as a refusal names it
        self._writer: Connection | None = None
        self._sqlite_writer: PoolProxiedConnection | None = None
        self._claimer: Connection | None = None

    def insert_episode(self, row: dict[str, Any]) -> bool:
        """One episode row (`db.ingest.episode_columns`) in its own transaction; True if new."""
        with translate_errors(self._engine.url, setting=self._setting):
            try:
                if self._engine.dialect.name == "sqlite":
                    if self._sqlite_writer is None:
                        self._sqlite_writer = self._engine.raw_connection()
                    # a sqlite3.Connection
                    return ingest.insert_episode_sqlite(self._sqlite_writer.dbapi_connection, row,
                                                        self._engine.dialect)
                if self._writer is None:
                    self._writer = self._engine.connect()
                return ingest.insert_episode_postgresql(self._writer, row)
            except BaseException:
                self.drop()  # a failed transaction is rolled back as the pool takes it
                raise

    def claim(self, request: queue.ClaimRequest) -> tuple[ScreenRow, AttemptRow] | None:
        """Run one claim (`db.queue.claim_postgresql` or `claim_sqlite`, by the engine's backend)."""
        if self._engine.dialect.name == "postgresql":
            with self._claimer_connection() as connection:
                return queue.claim_postgresql(connection, request)
        # A pooled connection (SQLite has no pre-ping): its BEGIN IMMEDIATE serializes claims.
        with translate_errors(self._engine.url, setting=self._setting), self._engine.begin() as connection:
            return queue.claim_sqlite(connection, request)

    @contextmanager
    def _claimer_connection(self) -> Iterator[Connection]:
        """The held autocommit connection (PostgreSQL); a failed one is dropped."""
        with translate_errors(self._engine.url, setting=self._setting):
            if self._claimer is None:
                self._claimer = self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")
            try:
                yield self._claimer
            except SQLAlchemyError:
                self.drop()
                raise

    def drop(self) -> None:
        """Release every held connection; the pool rolls back an open transaction."""
        held = (self._writer, self._sqlite_writer, self._claimer)
        self._writer = self._sqlite_writer = self._claimer = None
        for connection in held:
            if connection is not None:
                try:
                    connection.close()
                except (SQLAlchemyError, self._engine.dialect.loaded_dbapi.Error):
                    pass  # it is being dropped because it failed
