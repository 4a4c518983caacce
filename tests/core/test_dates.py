"""`core.dates.parse_when`: the one parser of `results --since/--until` and `audit --since`."""

from datetime import UTC, datetime

import pytest

from packbench.core.dates import InvalidDate, parse_when


def test_parse_when():
    assert parse_when("2026-01-31", option="--since") == datetime(2026, 1, 31, tzinfo=UTC)
    assert parse_when("2026-01-31", option="--until", end=True) == datetime(2026, 2, 1, tzinfo=UTC)
    assert parse_when("2026-01-31T12:00", option="--until", end=True) == datetime(2026, 1, 31, 12, tzinfo=UTC)
    assert parse_when("2026-01-31T12:00+02:00", option="--since") == datetime(2026, 1, 31, 10, tzinfo=UTC)
    with pytest.raises(InvalidDate, match="--since 'yesterday' is not an ISO date"):
        parse_when("yesterday", option="--since")


@pytest.mark.parametrize("text, expected", [
    ("2026-01-31T12:00Z", datetime(2026, 1, 31, 12, tzinfo=UTC)),
    ("2026-01-31 12:00:00.5", datetime(2026, 1, 31, 12, 0, 0, 500_000, tzinfo=UTC)),
    ("20260131", datetime(2026, 1, 31, tzinfo=UTC)),
    ("2026-W05-6", datetime(2026, 1, 31, tzinfo=UTC)),
    ("2026-01-31T00:30-01:00", datetime(2026, 1, 31, 1, 30, tzinfo=UTC)),
    (" 2026-01-31\n", datetime(2026, 1, 31, tzinfo=UTC)),
    ("0001-01-01", datetime(1, 1, 1, tzinfo=UTC)),
])
def test_every_form_either_command_took_is_taken(text, expected):
    """What either command took before they shared this parser (`results`: blanks around it;
    both: every form `datetime.fromisoformat` reads), each as an aware UTC datetime."""
    moment = parse_when(text, option="--since")
    assert moment == expected and moment.tzinfo is UTC


def test_parse_when_at_the_ends_of_the_calendar_is_no_overflow():
    """`--until 9999-12-31` (its next midnight does not exist) and a zone that moves a moment past
    year 1 or 9999 in UTC ended in an OverflowError traceback; the first is the end of time, the
    second one line naming the range."""
    assert parse_when("9999-12-31", option="--until", end=True) == datetime.max.replace(tzinfo=UTC)
    assert parse_when("9999-12-31", option="--since") == datetime(9999, 12, 31, tzinfo=UTC)
    for moment in ("0001-01-01T00:00+01:00", "9999-12-31T23:59-01:00"):
        with pytest.raises(InvalidDate, match=r"outside the years 1-9999 in UTC"):
            parse_when(moment, option="--since")


@pytest.mark.parametrize("text", ["", "   ", "garbage", "2026-13-01", "2026-02-30", "10000-01-01", "-2026-01-01",
                                  "١٢٣٤-٠١-٠١", "2026-01-01T25:00", "2026-01-01T10:00+25:00", "2026-01-01\x00",
                                  "9" * 1_000_000])
def test_bad_dates_are_one_short_line(text):
    """Bug caught: a megabyte `--since` was quoted whole in its refusal; a control character printed raw."""
    with pytest.raises(InvalidDate) as caught:
        parse_when(text, option="--since")
    message = str(caught.value)
    assert message.startswith("--since ") and "2026-01-31" in message, message
    assert len(message) < 250 and message.isprintable(), message
    assert isinstance(caught.value, ValueError)


def test_a_range_out_of_order_is_refused_in_the_words_typed(packbench_cli, tmp_path):
    """Bug caught: `results --since 2026-01-02 --until 2026-01-01` said "since
    2026-01-02T00:00:00+00:00 is not before until 2026-01-02T00:00:00+00:00" (the bare --until
    is its next midnight): one moment "not before" itself, neither option as typed."""
    from packbench.core.dates import check_order

    since, until = parse_when("2026-01-02", option="--since"), parse_when("2026-01-01", option="--until", end=True)
    with pytest.raises(InvalidDate) as caught:
        check_order(since, until, since_text="2026-01-02", until_text="2026-01-01")
    assert str(caught.value) == ("--since '2026-01-02' is not before --until '2026-01-01' (which ends at "
                                 "2026-01-02T00:00:00+00:00); swap them or widen the range")
    check_order(since, parse_when("2026-01-02", option="--until", end=True), since_text="", until_text="")
    url = f"sqlite:///{tmp_path / 'pb.db'}"
    assert packbench_cli("db", "upgrade", "--db", url, cwd=tmp_path).returncode == 0
    r = packbench_cli("results", "--since", "2026-01-02", "--until", "2026-01-01", "--db", url, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: --since '2026-01-02' is not before --until '2026-01-01'")
