"""Screen labels (revision 0010): a name, a note, key/value tags, and the sweep a screen is part of.

Functions over a session, called by thin `Store` methods. Labels describe a screen; they never
change what it measured, so they are not part of its protocol, its archive or its audit.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import and_, delete, func, or_, select, true
from sqlalchemy.orm import Session

from packbench.core.canonical import canonical_json
from packbench.core.text import show
from packbench.db.errors import InvalidFilter
from packbench.db.models import SCREEN_STATUSES, SqlProtocol, SqlScreen, SqlScreenTag
from packbench.db.queries import check_limit, check_one_of, protocol_matches, find_screen
from packbench.db.records import ScreenRow

TAG_KEY = re.compile(r"[A-Za-z0-9_.:-]{1,100}")
MAX_NAME, MAX_VALUE = 200, 200
MAX_NOTE = 10_000  # a paragraph or two; `screens tag` echoes it, the report and --json carry it
# What str.splitlines breaks at: a name with a carriage return or U+2028 is no more one line than with \n.
LINE_BREAKS = frozenset("\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029")


def check_tags(tags: Mapping[str, str]) -> dict[str, str]:
    """`tags` as a plain dict of strings, or InvalidFilter naming the bad key or value. A value
    is text or a number (written as text); None or a list would be stored as 'None' or '[...]'."""
    if not isinstance(tags, Mapping):
        raise InvalidFilter(f"tags are a mapping of key to value, e.g. tags={{'team': 'infra'}}, not "
                            f"{type(tags).__name__} {show(tags, 40)}")
    out: dict[str, str] = {}
    for key, value in tags.items():
        if not isinstance(key, str) or not TAG_KEY.fullmatch(key):
            raise InvalidFilter(f"tag key {show(key)} must be 1-100 letters, digits or _.:-; write e.g. "
                                f"--tag team=infra")
        if not isinstance(value, (str, int, float)):
            raise InvalidFilter(f"tag {key}: its value is text or a number, not {type(value).__name__}"
                                + ("; to drop the tag, untag it" if value is None else ""))
        value = str(value)
        # NUL: PostgreSQL refuses it, so both do
        if len(value) > MAX_VALUE or not LINE_BREAKS.isdisjoint(value) or "\x00" in value:
            raise InvalidFilter(f"tag {key}: its value must be one line of at most {MAX_VALUE} characters, "
                                f"without NUL")
        out[key] = value
    return out


def check_name(name: str | None) -> str | None:
    if name is not None and not (isinstance(name, str) and 0 < len(name) <= MAX_NAME and LINE_BREAKS.isdisjoint(name)
                                 and "\x00" not in name):
        raise InvalidFilter(f"screen name {str(name)[:40]!r} must be one line of 1-{MAX_NAME} characters, without NUL")
    return name


def check_note(note: str | None) -> str | None:
    """A note is text of at most MAX_NOTE characters, without NUL (PostgreSQL refuses it, so both do)."""
    if note is None:
        return None
    if not isinstance(note, str):
        raise InvalidFilter(f"a note is text, not {type(note).__name__}; pass a string")
    if "\x00" in note:
        raise InvalidFilter("a note cannot hold a NUL character (PostgreSQL refuses it); remove it")
    if len(note) > MAX_NOTE:
        raise InvalidFilter(f"a note of {len(note)} characters is more than {MAX_NOTE}; shorten it (or keep the text "
                            f"in a file and note its path)")
    return note


def check_untag(untag: Iterable[str]) -> set[str]:
    """The tag keys to drop. A string is refused: set('team') is {'t', 'e', 'a', 'm'}, which
    dropped tags t, e, a and m and kept team."""
    if isinstance(untag, (str, bytes)) or not isinstance(untag, Iterable):
        raise InvalidFilter(f"untag={show(untag, 40)}: give the tag keys to drop as a list, e.g. untag=('team',)")
    keys = list(untag)
    bad = [k for k in keys if not isinstance(k, str)]
    if bad:
        raise InvalidFilter(f"untag: tag key {show(bad[0], 40)} is not text; give keys such as 'team'")
    return set(keys)


def label(session: Session, ref: int | str, *, name: str | None = None, note: str | None = None,
          tags: Mapping[str, str] | None = None, untag: Iterable[str] = ()) -> int:
    """Set a screen's name and note (None leaves each as it is), set `tags` (a key already there
    takes the new value) and drop the `untag` keys; return the screen id."""
    screen = find_screen(session, ref, for_update=True)
    if name is not None:
        screen.name = check_name(name)
    if note is not None:
        screen.note = check_note(note)
    drop = check_untag(untag)
    if drop:
        session.execute(delete(SqlScreenTag).where(SqlScreenTag.screen_id == screen.id, SqlScreenTag.key.in_(drop)))
    wanted = check_tags(tags or {})
    if wanted:
        held = {t.key: t for t in session.scalars(select(SqlScreenTag).where(
            SqlScreenTag.screen_id == screen.id, SqlScreenTag.key.in_(wanted)))}
        for key, value in wanted.items():
            if key in held:
                held[key].value = value
            else:
                session.add(SqlScreenTag(screen_id=screen.id, key=key, value=value))
    session.flush()
    return screen.id


def set_sweep(session: Session, screen_id: int, *, sweep_id: str, point: Mapping[str, Any]) -> None:
    """Record that `screen_id` is the point `point` ({dotted field: value}) of sweep `sweep_id`."""
    screen = session.get(SqlScreen, screen_id)
    if screen is None:
        raise InvalidFilter(f"no screen with id {screen_id}")
    screen.sweep_id = sweep_id
    screen.sweep_point = canonical_json(dict(point)).decode("utf-8")


def tags_of(session: Session, screen_ids: Iterable[int]) -> dict[int, dict[str, str]]:
    """Each screen's tags ({} for one without), sorted by key in code-point order (here, not by
    ORDER BY, which follows PostgreSQL's collation: en_US put 'a' before 'B', SQLite after)."""
    ids = list(screen_ids)
    found: dict[int, list[tuple[str, str]]] = {i: [] for i in ids}
    for chunk in range(0, len(ids), 500):  # bounded IN lists
        rows = session.execute(select(SqlScreenTag.screen_id, SqlScreenTag.key, SqlScreenTag.value)
                               .where(SqlScreenTag.screen_id.in_(ids[chunk:chunk + 500])))
        for screen_id, key, value in rows:
            found[screen_id].append((key, value))
    return {i: dict(sorted(pairs)) for i, pairs in found.items()}


def _having_tags(tags: Mapping[str, str]) -> Any:
    """Screen ids carrying every tag of `tags` (a value of '*' matches any value of that key)."""
    criteria = [and_(SqlScreenTag.key == k, true() if v == "*" else SqlScreenTag.value == v) for k, v in tags.items()]
    return (select(SqlScreenTag.screen_id).where(or_(*criteria)).group_by(SqlScreenTag.screen_id)
            .having(func.count(SqlScreenTag.id) == len(tags)))


def screens(session: Session, *, protocol: str | None = None, status: str | None = None,
            name: str | None = None, tags: Mapping[str, str] | None = None, sweep_id: str | None = None,
            ids: Iterable[int] | None = None, limit: int | None = None) -> list[ScreenRow]:
    """Screens, newest first, filtered by protocol (name or SHA-256 prefix), status, name (exact),
    every one of `tags`, sweep id, or an id list."""
    check_one_of(status, SCREEN_STATUSES, "screen status")
    for what, value in (("name", name), ("sweep", sweep_id)):
        if value is not None and not isinstance(value, str):  # a list reached the driver: "database error"
            raise InvalidFilter(f"{what}={show(value, 40)}: give a {what} as text, or None for any")
    query = (select(SqlScreen).join(SqlProtocol, SqlProtocol.id == SqlScreen.protocol_id)
             .order_by(SqlScreen.id.desc()))
    if protocol is not None:
        query = query.where(protocol_matches(protocol))
    if status is not None:
        query = query.where(SqlScreen.status == status)
    if name is not None:
        query = query.where(SqlScreen.name == name)
    if sweep_id is not None:
        query = query.where(SqlScreen.sweep_id == sweep_id)
    if ids is not None:
        query = query.where(SqlScreen.id.in_(list(ids)))
    if tags:
        query = query.where(SqlScreen.id.in_(_having_tags(check_tags(tags))))
    check_limit(limit, "screen")
    if limit is not None:
        query = query.limit(limit)
    return [s.to_record() for s in session.scalars(query)]


def latest_sweep(session: Session) -> str | None:
    """The sweep id of the newest screen that is part of a sweep, or None when no screen is."""
    query = select(SqlScreen.sweep_id).where(SqlScreen.sweep_id.is_not(None)).order_by(SqlScreen.id.desc()).limit(1)
    return session.scalars(query).first()


def tagged_ids(session: Session, tags: Mapping[str, str]) -> set[int]:
    """The ids of the screens carrying every one of `tags`."""
    return set(session.scalars(_having_tags(check_tags(tags))))
