"""Running one attempt of a screen: what the driver does with each thing a worker returns.

`ScreenRun` holds no Ray: whoever talks to the worker (the dispatcher, service/dispatcher/)
calls `begin`, `loaded`, `record` per finished episode, then `finish` or `fail`. The database
and the archive are written by the driver only, in this order per episode: the archive member
(fsynced), then the database row, so a crash between the two leaves the evidence and loses no
row the archive lacks.

Failures are kept: an interrupted or failed attempt stays in the database with its cause, and
its partial archive stays on disk, auditable as incomplete.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from packbench.core.archive import PLAN_NAME, PROTOCOL_NAME, VERDICTS_NAME, WORKER_NAME, ArchiveWriter, plan_json, worker_json
from packbench.core.errors import PackbenchError
from packbench.core.fidelity import of_episode
from packbench.core.gates import compute_verdicts
from packbench.core.outcome import failure_line, sealed_status
from packbench.core.plan import plan
from packbench.db.errors import DatabaseUnavailable
from packbench.core.protocol import Protocol, expand

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScreenOutcome:
    screen_id: int
    attempt_id: int
    archive_path: Path
    archive_sha256: str | None
    status: str  # done | failed | interrupted | lost | cancelled
    error: str | None
    bad_input: bool = False  # failed on input the user can correct (a broken checkpoint): exit 2
    storage: bool = False  # failed because the archive's storage refused a write (a full disk): exit 74
    attempt_number: int | None = None
    screen_status: str | None = None  # the screen's after this attempt: `queued` when it runs again
    failed_episodes: int = 0  # of a sealed attempt: its episodes that failed (every one: the attempt failed)
    episodes: int = 0  # of a sealed attempt: its episodes
    first_failure: str | None = None  # of a sealed attempt with failed episodes: the first one, on one line

    @property
    def requeued(self) -> bool:
        """The attempt ended but the screen did not: it is queued for its next attempt."""
        return self.status != "done" and self.screen_status == "queued"


class ScreenRun:
    """One attempt: archive writer, database rows, verdicts. Driven by the caller.

    `progress(message, **event)` hears each step; events carry screen, done, total and the
    condition of the episode just recorded (cli/progress.py draws them).
    """

    def __init__(self, store, *, screen, attempt, protocol: Protocol | dict, archive_path: Path,
                 freeze: dict, progress: Callable[..., None] = lambda msg, **event: None, signer=None) -> None:
        self.store, self.screen, self.attempt = store, screen, attempt
        self.protocol = expand(protocol)
        self.archive_path = Path(archive_path)
        self.progress = progress
        self.writer: ArchiveWriter | None = None
        self.entries: list[dict] = plan(self.protocol)
        self.episodes: list[dict] = []
        self.start: dict | None = None
        self.env: dict | None = None
        self.freeze = freeze
        self.signer = signer  # core.provenance.Signer: signs the sealed archive (<archive>.sig); None: unsigned
        self.unpersisted: list[int] = []  # archived episodes whose row is not written yet (a database outage)
        self._sealed: tuple[list[dict], str, str | None] | None = None  # (verdicts, SHA-256, signer) once sealed

    @property
    def done_count(self) -> int:
        return len(self.episodes)

    def begin(self, env: dict) -> None:
        """The worker is placed: open the archive (exclusive create) and write the protocol."""
        self.env = env
        self.writer = ArchiveWriter(self.archive_path)
        self.writer.add_json(PROTOCOL_NAME, self.protocol.body_dict())

    def loaded(self, start: dict, token_ids: list[list[int]]) -> list[dict]:
        """The model is loaded: write the plan and the worker's start record; return the plan."""
        self.start = start
        self.writer.add_json(PLAN_NAME, plan_json(self.entries, token_ids))
        self.writer.add_json(WORKER_NAME, worker_json(environment=self.env, start=start,
                                                      model_dir=self.screen.model_dir, source_freeze=self.freeze))
        self.progress(f"screen {self.screen.id} attempt {self.attempt.number}: {len(self.entries)} episodes "
                      f"on {self.env['device']}", screen=self.screen.id, done=0, total=len(self.entries),
                      condition=None)
        return self.entries

    def record(self, record: dict, *, persist: bool = True) -> None:
        """One finished episode: archive member(s) first (fsynced), then its database row.

        `persist` False (the database is known to be down) writes the archive only. Either way
        an episode whose row could not be written is kept in `unpersisted` (its plan index)
        and counts as done: reconciliation inserts its row from the archive
        (service/reconcile.py). A `DatabaseUnavailable` from the row's write is raised after
        this bookkeeping, so that the caller learns the database is down."""
        logits, trace = record.pop("logits"), record.pop("trace")
        forced = record.pop("forced_logits", None)
        active = record.pop("active_sets", None)  # a traced protocol's trace file (docs/traces.md)
        if record.get("tier") == "approximate":
            record["fidelity"] = self.fidelity_of({**record, "forced_logits": forced})
        self.writer.add_episode(record, logits, trace, forced, active=active)
        failure: DatabaseUnavailable | None = None
        if persist:
            try:
                self.store.put_episode(self.attempt.id, record)
            except DatabaseUnavailable as e:
                failure = e
        if failure is not None or not persist:
            self.unpersisted.append(record["plan_index"])
        self.episodes.append({**record, "logits": logits, "forced_logits": forced})
        entry = self.entries[record["plan_index"]]
        wall = record.get("wall_s")
        took = f", wall {wall:.3f} s" if isinstance(wall, (int, float)) else ""
        self.progress(f"  episode {entry['index']:3d} {entry['condition']:>14} {entry['role']:6} "
                      f"prompt {entry['prompt']} {record['status']}{took}", screen=self.screen.id,
                      done=len(self.episodes),
                      total=len(self.entries), condition=entry["condition"])
        if failure is not None:
            raise failure

    def fidelity_of(self, episode: dict) -> dict | None:
        """An approximate episode's fidelity figures (core/fidelity.py) against the reference
        episode it was teacher-forced on, recorded before any earlier one; None when they cannot
        be computed (the fidelity gate then says why, and the auditor recomputes the same)."""
        by_index = {e["plan_index"]: e for e in self.episodes}
        try:
            return of_episode(episode, by_index, reference=self.protocol.reference).as_dict()
        except ValueError:
            return None

    def finish(self) -> ScreenOutcome:
        """Every planned episode is in: verdicts, seal, store them; the attempt is done, or
        failed when every episode failed (`sealed_status`: it is kept, not requeued)."""
        if self._sealed is None:  # a finish the database interrupted resumes after the seal
            verdicts = compute_verdicts(self.protocol, self.episodes, start=self.start)
            self.writer.add_json(VERDICTS_NAME, verdicts)
            sha = self.writer.seal({"protocol_sha256": self.protocol.sha256, "screen_id": self.screen.id,
                                    "attempt": self.attempt.number, "environment": self.env,
                                    "source_freeze": self.freeze})
            key_id = None
            if self.signer is not None:
                try:
                    self.signer.sign_archive(self.archive_path, sha, self.writer.manifest_sha256)
                    key_id = self.signer.key_id
                except (OSError, PackbenchError) as e:  # the archive stays valid, unsigned: --trust refuses it
                    log.warning("screen %s: archive not signed: %s", self.screen.id, e)
            self._sealed = (verdicts, sha, key_id)
        verdicts, sha, key_id = self._sealed
        model_sha = (self.start or {}).get("model_sha256")
        if key_id is not None or model_sha is not None:
            self.store.set_attempt_evidence(self.attempt.id, model_sha256=model_sha, signer_key_id=key_id)
        self.store.put_verdicts(self.attempt.id, verdicts)
        status, error = sealed_status(self.episodes, screen_id=self.screen.id)
        after = self.store.finish_attempt(self.attempt.id, status=status, error=error, archive_sha256=sha)
        log.info("screen %s attempt %s %s: %s", self.screen.id, self.attempt.number, status, self.archive_path)
        failed = [e for e in self.episodes if e.get("status") != "ok"]
        return ScreenOutcome(self.screen.id, self.attempt.id, self.archive_path, sha, status, error,
                             attempt_number=self.attempt.number, screen_status=after,
                             failed_episodes=len(failed), episodes=len(self.episodes),
                             first_failure=failure_line(failed[0]) if failed else None)

    def fail(self, status: str, error: str, *, requeue: bool = False, bad_input: bool = False,
             storage: bool = False) -> ScreenOutcome:
        """End the attempt without verdicts; its partial archive stays on disk as evidence.

        `requeue`: the cause was not the screen's (its worker died, its archive's disk is
        full): the screen goes back to the queue while it has attempts left
        (Store.finish_attempt)."""
        after = self.store.finish_attempt(self.attempt.id, status=status, error=error, requeue=requeue)
        log.info("screen %s attempt %s %s: %s", self.screen.id, self.attempt.number, status, error)
        return ScreenOutcome(self.screen.id, self.attempt.id, self.archive_path, None, status, error, bad_input,
                             storage=storage, attempt_number=self.attempt.number, screen_status=after)


def cause_of(e: BaseException) -> str:
    """One line naming an exception (a RayTaskError wraps the worker's: report the cause)."""
    cause: Any = getattr(e, "cause", None) or e
    text = str(cause).splitlines()[0] if str(cause) else ""
    return f"{type(cause).__name__}: {text}"


def is_bad_input(e: BaseException) -> bool:
    """The worker refused input the user can correct (a PackbenchError, e.g. a broken checkpoint)."""
    from packbench.core.errors import PackbenchError

    return isinstance(getattr(e, "cause", None) or e, PackbenchError)
