"""`packbench.connect(url)`: a results database as records and DataFrames, and a way to submit."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from packbench.core.errors import PackbenchError
from packbench.core.settings import DB_URL_ENV, Settings
from packbench.api.frames import Records

ENDED = ("done", "failed", "cancelled")
MAX_WORKERS = 1024  # as `packbench dispatch --workers`


def _seconds(value: Any, *, zero: bool) -> bool:
    """A finite real number of seconds, > 0 (or >= 0 with `zero`); never a bool."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return value >= 0 if zero else value > 0


def connect(url: str | None = None, *, upgrade: bool = False) -> Client:
    """The database at `url` (default: $PACKBENCH_DB_URL or sqlite:///packbench.db). A database
    not at the newest schema is refused with the command that fixes it, unless `upgrade`
    migrates it first (as `packbench db upgrade` does)."""
    from packbench.db.session import sqlite_file
    from packbench.db.store import Store

    setting = "connect()'s url" if url is not None else DB_URL_ENV  # what a refusal names as the fix
    missing = None if upgrade else sqlite_file(url, setting=setting)
    if missing is not None and not missing.exists():  # opening it would leave an empty file there, then refuse it
        raise PackbenchError(f"no database at {missing} (no such file here); connect(url, upgrade=True) or "
                             f"`packbench db upgrade` creates it, or give the URL of the database that holds "
                             f"your screens")
    store = Store(url, setting=setting)
    if upgrade:
        store.upgrade()
    store.check_head()
    return Client(store)


class Client:
    """A results database. Listings return `Records` (plain immutable rows: `db.records`'s
    ScreenRow, EpisodeRow, StoredVerdict, AuditRow); `.frame()` turns one into a DataFrame.

    Selecting screens, for every listing: `screen` (an id or 'latest'), or any of `protocol`
    (name or SHA-256 prefix), `status`, `name`, `tags` ({key: value}, every one must match; a
    value '*' matches any), `sweep` (a sweep id). Episodes, verdicts and audits come from each
    selected screen's latest attempt (`attempts='all'`: every attempt, failed ones included).
    """

    def __init__(self, store) -> None:
        self.store = store
        self._protocols: dict[int, Any] = {}
        self._tier_maps: dict[str, dict[str, str]] = {}

    @property
    def url(self) -> str:
        return self.store.url

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- listings --------------------------------------------------------------------------

    def screens(self, *, screen: int | str | None = None, protocol: str | None = None, status: str | None = None,
                name: str | None = None, tags: Mapping[str, str] | None = None, sweep: str | None = None,
                limit: int | None = None) -> Records:
        """Screens, newest first; the frame adds `protocol`, `protocol_sha256`, `tags` and the
        sweep point's fields (`point.<field>`)."""
        rows = self._select(screen=screen, protocol=protocol, status=status, name=name, tags=tags, sweep=sweep,
                            limit=limit)
        tags_of = self.store.screen_tags([s.id for s in rows])
        context = []
        for s in rows:
            p = self._protocol(s.protocol_id)
            context.append({"protocol": p.name, "protocol_sha256": p.sha256, "tags": tags_of.get(s.id, {}),
                            **{f"point.{k}": v for k, v in s.point.items()}})
        return Records(rows, context=context)

    def attempts(self, **select: Any) -> Records:
        """Every attempt of the selected screens (failed, lost and interrupted ones too)."""
        rows, context = [], []
        for s in self._select(**select):
            for a in self.store.attempts(s.id):
                rows.append(a)
                context.append({"screen_id": s.id})
        return Records(rows, context=context)

    def episodes(self, *, condition: str | None = None, role: str | None = None, attempts: str = "latest",
                 **select: Any) -> Records:
        """Episode rows (core/record.py's stored fields), optionally one condition or role
        (warmup | scored); the frame leads with screen_id, attempt, protocol, name and tier."""
        from packbench.db.queries import check_one_of

        check_one_of(role, ("scored", "warmup"), "role")  # as `results --role`: a typo is no empty listing
        return self._per_attempt(self.store.episodes, attempts, select,
                                 keep=lambda e: (condition is None or e.condition == condition)
                                 and (role is None or e.role == role))

    def verdicts(self, *, gate: str | None = None, attempts: str = "latest", **select: Any) -> Records:
        """Verdict rows of the selected screens, optionally one gate; the frame leads with
        screen_id, attempt, protocol, name and tier (of the verdict's condition)."""
        from packbench.db.queries import GATES, check_one_of

        check_one_of(gate, GATES, "gate")  # as `results --gate`: a typo is no empty listing
        return self._per_attempt(self.store.verdicts, attempts, select,
                                 keep=lambda v: gate is None or v.gate == gate)

    def audits(self, *, attempts: str = "latest", **select: Any) -> Records:
        """Audit rows (every audit run) of the selected screens' attempts."""
        return self._per_attempt(self.store.audits, attempts, select, keep=lambda a: True)

    def history(self, protocol: str, *, condition: str | None = None, metric: str | None = None):
        """The protocol's screens in order of their source commit, each figure's median and
        spread, the steps found and the exact counters that changed (`packbench history`;
        service/history.py states the method). `.regressions(pct)` lists what --fail-above fails."""
        from packbench.service.history import history

        return history(self.store, protocol, condition=condition, metric=metric)

    # -- labels, submitting, waiting ------------------------------------------------------

    def label(self, screen: int | str, *, name: str | None = None, note: str | None = None,
              tags: Mapping[str, str] | None = None, untag: tuple[str, ...] = ()) -> int:
        """Name, annotate or tag a screen (`packbench screens tag`); returns its id."""
        return self.store.label_screen(screen, name=name, note=note, tags=tags, untag=untag)

    def submit(self, protocol: str | Path, *, name: str | None = None, note: str | None = None,
               tags: Mapping[str, str] | None = None, priority: int = 0, replicas: int = 1,
               gpu_type: str | None = None) -> list[int]:
        """Freeze and queue a protocol file as `packbench submit` does; returns the screen ids."""
        from packbench.service.submit import submit

        return submit(self.store, Path(protocol), priority=priority, replicas=replicas, gpu_type=gpu_type,
                      name=name, note=note, tags=tags)

    def run(self, screen: int | None = None, *, settings: Settings | None = None,
            archive_dir: str | Path | None = None, workers: int | None = None) -> list:
        """Run queued screens now on GPU worker actors (embedded Ray, or `settings.address`), as
        `packbench dispatch` does; `screen`: only that one (`submit --wait`). Returns the
        dispatcher's outcomes (`service.screen.ScreenOutcome`)."""
        from packbench.cluster.pool import RayPool
        from packbench.service.dispatcher import Dispatcher

        base = settings or Settings(db_url=self.url)
        if archive_dir is not None:
            import dataclasses

            base = dataclasses.replace(base, archive_dir=Path(archive_dir))
        if workers is not None and (type(workers) is not int or not 1 <= workers <= MAX_WORKERS):
            raise PackbenchError(f"workers={workers!r}: give an integer from 1 to {MAX_WORKERS}, or None for one "
                                 f"per GPU of the cluster")
        options: dict[str, Any] = {"only_screen": screen}
        if screen is not None:
            options["workers"] = 1
        elif workers is not None:
            options["workers"] = workers
        return Dispatcher(self.store, base, RayPool(base), **options).run()

    def wait(self, screen: int | str, *, timeout_s: float | None = None, poll_s: float = 1.0,
             sleep: Callable[[float], None] = time.sleep):
        """Block until the screen has ended (done, failed or cancelled) while something else runs
        it (a `packbench dispatch`); returns its ScreenRow. TimeoutError after `timeout_s`
        (None: no limit); the database is read every `poll_s` seconds (never past the timeout).
        Both are finite numbers of seconds: `timeout_s` >= 0, `poll_s` > 0."""
        if timeout_s is not None and not _seconds(timeout_s, zero=True):
            raise PackbenchError(f"timeout_s={timeout_s!r}: give a finite number of seconds >= 0, or None to wait "
                                 f"without a limit")
        if not _seconds(poll_s, zero=False):
            raise PackbenchError(f"poll_s={poll_s!r}: give a finite number of seconds > 0, e.g. 1.0")
        start = time.monotonic()
        while True:
            row = self.store.screen(screen)
            if row.status in ENDED:
                return row
            waited = time.monotonic() - start
            if timeout_s is not None and waited >= timeout_s:
                raise TimeoutError(f"screen {row.id} is still {row.status} after {timeout_s:g} s")
            sleep(poll_s if timeout_s is None else min(poll_s, timeout_s - waited))

    # -- internals ------------------------------------------------------------------------

    def _protocol(self, protocol_id: int):
        if protocol_id not in self._protocols:
            self._protocols[protocol_id] = self.store.protocol(protocol_id)
        return self._protocols[protocol_id]

    def _select(self, *, screen: int | str | None = None, protocol: str | None = None, status: str | None = None,
                name: str | None = None, tags: Mapping[str, str] | None = None, sweep: str | None = None,
                limit: int | None = None) -> list:
        if screen is not None:
            if any(v is not None for v in (protocol, status, name, tags, sweep)):
                raise PackbenchError("give either screen= or the filters (protocol, status, name, tags, sweep)")
            return [self.store.screen(screen)]
        if sweep is not None:  # 'latest' as the CLI reads it (it matched no sweep id: an empty listing)
            from packbench.service.sweep import resolve_sweep

            sweep = resolve_sweep(self.store, sweep)
        return self.store.find_screens(protocol=protocol, status=status, name=name, tags=tags, sweep_id=sweep,
                                       limit=limit)

    def _per_attempt(self, fetch: Callable[[int], list], attempts: str, select: dict, *,
                     keep: Callable[[Any], bool]) -> Records:
        if attempts not in ("latest", "all"):
            raise PackbenchError(f"attempts={attempts!r}: give 'latest' or 'all'")
        rows, context = [], []
        for s in self._select(**select):
            chosen = self.store.attempts(s.id)
            if attempts == "latest":
                chosen = chosen[-1:]
            protocol = self._protocol(s.protocol_id)
            tiers = self._tiers(protocol.sha256)
            for a in chosen:
                for row in fetch(a.id):
                    if keep(row):
                        rows.append(row)
                        # A row of a condition says its tier, as `results` does: a frame sorted by
                        # wall_s never ranks int8 among exact packets unlabelled.
                        context.append({"screen_id": s.id, "attempt": a.number, "protocol": protocol.name,
                                        "name": s.name, **({"tier": tiers.get(row.condition)}
                                                           if hasattr(row, "condition") else {})})
        return Records(rows, context=context)

    def _tiers(self, sha256: str) -> dict[str, str]:
        """condition name -> tier (exact | approximate) of the protocol with this SHA-256."""
        if sha256 not in self._tier_maps:
            self._tier_maps[sha256] = self.store.condition_tiers([sha256]).get(sha256, {})
        return self._tier_maps[sha256]
