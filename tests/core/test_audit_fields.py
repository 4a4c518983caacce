"""The audit against the database, field by field: every verdict field (passed, value,
threshold, interval, episodes, detail) and every audited episode column the database holds
is compared, so a database changed in any one of them, by as little as one ulp, disagrees with
the archive; and an unchanged database agrees."""

import math

import pytest

from bench.audit import synthetic_protocol, write_synthetic_screen
from packbench.core.audit import EPISODE_FIELDS, audit_archive


@pytest.fixture(scope="module")
def screen(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("screen") / "screen.zip"
    out = write_synthetic_screen(path, synthetic_protocol(prompts_n=2, repetitions=2))
    return {**out, "path": path}


def db_verdicts(screen) -> list[dict]:
    """Verdict rows as the database returns them: floats, an interval as a tuple, episodes, detail."""
    return [{**v, "interval": tuple(v["interval"]) if v["interval"] else None, "episodes": list(v["episodes"])}
            for v in screen["verdicts"]]


def db_episodes(screen) -> list[dict]:
    """One row per archived episode holding every audited column, read from the worker's record."""
    rows = []
    for e in screen["episodes"]:
        row = {"plan_index": e["plan_index"]}
        for column, path in EPISODE_FIELDS.items():
            value = e
            for key in path:
                value = value.get(key) if isinstance(value, dict) else None
            if value is not None:
                row[column] = list(value) if isinstance(value, tuple) else value
        rows.append(row)
    return rows


EXACT_COLUMNS = [c for c in EPISODE_FIELDS if not c.startswith("fidelity_")]


def _up(x):
    return math.nextafter(x, math.inf)


# field -> an edit of one stored verdict that changes only that field (the smallest change)
EDITS = {
    "passed": lambda v: v.update(passed=not v["passed"]),
    "value": lambda v: v.update(value=_up(v["value"]) if v["value"] is not None else 0.0),
    "threshold": lambda v: v.update(threshold=_up(v["threshold"]) if v["threshold"] is not None else 0.0),
    "interval": lambda v: v.update(interval=None if v["interval"] is None else (v["interval"][0], _up(v["interval"][1]))),
    "episodes": lambda v: v.update(episodes=v["episodes"] + [max(v["episodes"], default=0) + 100]),
    "detail": lambda v: v.update(detail=v["detail"] + " "),
    "phase-as-int": lambda v: v.update(passed=int(v["passed"])),  # 1 is not True: a verdict is a bool
}


def test_an_unchanged_database_agrees(screen):
    report = audit_archive(screen["path"], expected_sha256=screen["sha256"], db_verdicts=db_verdicts(screen),
                           db_episodes=db_episodes(screen))
    assert report.agrees, report.problems
    # every audited column is compared; an exact screen has no fidelity figures
    assert set(db_episodes(screen)[0]) == {"plan_index", *EXACT_COLUMNS}


@pytest.mark.parametrize("field", list(EDITS))
def test_every_verdict_field_changed_in_the_database_disagrees(screen, field):
    verdicts = db_verdicts(screen)
    changed = [v for v in verdicts if field != "interval" or v["interval"] is not None]
    assert changed, "the screen has no verdict with that field"
    for v in changed:
        EDITS[field](v)
    report = audit_archive(screen["path"], db_verdicts=verdicts)
    assert not report.agrees
    name = "passed" if field == "phase-as-int" else field
    named = {p.split(" differs in ")[0] for p in report.problems if p.endswith("]") and f" differs in {name}:" in p}
    assert named == {f"database verdict {v['gate']}/{v['condition']}/{v['phase']}" for v in changed}
    assert len(report.problems) == len(changed)  # nothing else is blamed


@pytest.mark.parametrize("column", EXACT_COLUMNS)
def test_every_audited_episode_column_changed_in_the_database_disagrees(screen, column):
    rows = db_episodes(screen)
    row = next(r for r in rows if column in r)
    old = row[column]
    row[column] = (old + [1] if isinstance(old, list) else f"{old}x" if isinstance(old, str)
                   else _up(old) if isinstance(old, float) else old + 1)
    report = audit_archive(screen["path"], db_episodes=rows)
    assert report.problems == [f"database episode {row['plan_index']} {column} {row[column]!r} != archive {old!r}"]
