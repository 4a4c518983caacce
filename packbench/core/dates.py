"""Dates the user types (`results --since/--until`, `audit --since`): one parser, one refusal.

Pure: text in, an aware UTC datetime out.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

from packbench.core.errors import PackbenchError
from packbench.core.text import show


class InvalidDate(PackbenchError, ValueError):
    """A date option's text is no ISO date or date-time, or names a moment outside years 1-9999 in UTC."""


def parse_when(text: str, *, option: str, end: bool = False) -> datetime:
    """`text` (ISO 8601 as `datetime.fromisoformat` reads it: 2026-01-31, 20260131, 2026-W05-6,
    2026-01-31T12:00, 2026-01-31 12:00:00.5, a `Z` or `+02:00` offset; blanks around it ignored)
    as an aware UTC datetime. No offset means UTC; an offset is converted to UTC.

    A bare date names a whole day: as a start (`end=False`) its midnight, as an end (`end=True`)
    the next midnight, so `--until 2026-01-31` includes the 31st; the end of 9999-12-31 is the end
    of time. Anything else raises `InvalidDate`, one line naming `option` and what to write.
    """
    stripped = text.strip()
    try:
        value = datetime.fromisoformat(stripped)
    except ValueError:
        raise InvalidDate(f"{option} {show(text)} is not an ISO date or date/time; write e.g. 2026-01-31, "
                          f"2026-01-31T12:00 (UTC) or 2026-01-31T12:00+02:00") from None
    try:
        value = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    except OverflowError:  # e.g. 0001-01-01T00:00+01:00: a moment before year 1 in UTC
        raise InvalidDate(f"{option} {show(text)} is outside the years 1-9999 in UTC; give a date within them") \
            from None
    if end and _is_bare_date(stripped):
        # the next midnight; after 9999-12-31 there is none, and the end of time includes that day
        value = datetime.max.replace(tzinfo=UTC) if value.date() == date.max else value + timedelta(days=1)
    return value


def _is_bare_date(text: str) -> bool:
    try:
        date.fromisoformat(text)
    except ValueError:
        return False
    return True


def check_order(since: datetime | None, until: datetime | None, *, since_text: str, until_text: str) -> None:
    """Refuse a `--since` not before `--until` (`parse_when`'s values of the texts typed), in the
    words the user typed: a bare `--until` date is its next midnight, and the store's refusal,
    which shows the values, read "since 2026-01-02T00:00 is not before until 2026-01-02T00:00"
    for `--since 2026-01-02 --until 2026-01-01`."""
    if since is None or until is None or since < until:
        return
    ends = f" (which ends at {until.isoformat()})" if _is_bare_date(until_text.strip()) else ""
    raise InvalidDate(f"--since {show(since_text)} is not before --until {show(until_text)}{ends}; swap them or "
                      f"widen the range")
