"""A database edited after a screen ran must not audit AGREE: each edit below once did.

The screen runs on the fake pool (tests/service/fake_pool.py: its records hold no memory figures
and no fidelity), is audited AGREE, then one column is changed in SQLite directly (as a hand edit
or a faulty tool would) and the same audit must DISAGREE, naming what differs; putting the value
back agrees again with the first digest."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from packbench.service.audit import audit_screens
from packbench.service.submit import submit
from tests.service.fake_pool import FakePool
from tests.service.screens import dispatcher, protocol_file


@pytest.fixture
def ran(store, tmp_path):
    """(store, database file, screen id, attempt id, the agreeing audit's digest)."""
    (screen_id,) = submit(store, protocol_file(tmp_path))
    (outcome,) = dispatcher(store, tmp_path, FakePool()).run()
    assert outcome.status == "done"
    (audit,) = audit_screens(store, [screen_id])
    assert audit.result == "agree", audit.report.problems
    return store, tmp_path / "packbench.db", screen_id, outcome.attempt_id, audit.report.digest


def edited(db: Path, sql: str, *args) -> None:
    with sqlite3.connect(db) as connection:
        assert connection.execute(sql, args).rowcount >= 1, sql


def problems(store, screen_id: int) -> list[str]:
    (audit,) = audit_screens(store, [screen_id])
    assert audit.result == "disagree" and not audit.agrees
    return audit.report.problems


def agrees_again(store, screen_id: int, digest: str) -> None:
    (audit,) = audit_screens(store, [screen_id])
    assert audit.result == "agree" and audit.report.digest == digest, audit.report.problems


@pytest.mark.parametrize("column,value", [("peak_sampled_bytes", 123456), ("peak_allocated_bytes", 4096),
                                          ("fidelity_mean_kl", 0.5), ("fidelity_top1", 1.0)])
def test_a_row_holding_a_figure_its_archive_never_held_disagrees(ran, column, value):
    # Bug caught: the auditor skipped every column whose archived value was None, so a row given
    # a peak memory or a fidelity the episode never measured (an exact one has no fidelity)
    # audited AGREE, and `results` showed the invented figure as audited.
    store, db, screen_id, attempt_id, digest = ran
    edited(db, f"UPDATE episodes SET {column} = ? WHERE attempt_id = ? AND plan_index = 2", value, attempt_id)
    assert problems(store, screen_id) == [f"database episode 2 {column} {value!r} != archive None"]
    edited(db, f"UPDATE episodes SET {column} = NULL WHERE attempt_id = ? AND plan_index = 2", attempt_id)
    agrees_again(store, screen_id, digest)


def test_a_screen_whose_row_names_another_protocol_disagrees(ran):
    # Bug caught: the screen's protocol (what `results --protocol` and `compare --protocol` file it
    # under) was never compared with the protocol its archive ran: pointing the screen at another
    # protocol row, or editing the stored protocol's body or SHA-256, audited AGREE.
    store, db, screen_id, attempt_id, digest = ran
    with sqlite3.connect(db) as connection:
        protocol_id, sha, body = connection.execute(
            "SELECT p.id, p.sha256, p.canonical_json FROM protocols p JOIN screens s ON s.protocol_id = p.id "
            "WHERE s.id = ?", (screen_id,)).fetchone()
    other = "0" * 64
    edited(db, "INSERT INTO protocols (id, sha256, name, canonical_json, created_at) "
               "SELECT 99, ?, name, canonical_json, created_at FROM protocols WHERE id = ?", other, protocol_id)
    edited(db, "UPDATE screens SET protocol_id = 99 WHERE id = ?", screen_id)
    assert problems(store, screen_id) == [
        f"the archive ran protocol {sha}; the database's screen names protocol {other} "
        f"(whose stored body hashes to {sha})"]
    edited(db, "UPDATE protocols SET sha256 = ?, canonical_json = ? WHERE id = 99", other,
           body.replace('"prefix_tokens":8', '"prefix_tokens":9'))
    (line,) = problems(store, screen_id)
    assert line.startswith(f"the archive ran protocol {sha}; the database's screen names protocol {other} "
                           f"(whose stored body hashes to ") and sha not in line.split("names protocol ")[1]
    edited(db, "UPDATE screens SET protocol_id = 1000 WHERE id = ?", screen_id)  # a row that is gone
    assert problems(store, screen_id) == [
        f"the archive ran protocol {sha}; the database's screen names protocol "
        f"(none: the database lacks protocol row 1000)"]
    edited(db, "UPDATE screens SET protocol_id = ? WHERE id = ?", protocol_id, screen_id)
    agrees_again(store, screen_id, digest)
    edited(db, "UPDATE protocols SET canonical_json = ? WHERE id = ?",
           body.replace('"prefix_tokens":8', '"prefix_tokens":9'), protocol_id)  # its own body edited
    (line,) = problems(store, screen_id)
    assert line.startswith(f"the archive ran protocol {sha}; the database's screen names protocol {sha} "
                           f"(whose stored body hashes to ")


def test_a_verdict_whose_detail_or_episodes_were_edited_disagrees(ran):
    # Bug caught: the verdicts' `detail` (what `results` and `screens show` print under a verdict)
    # and `episodes_json` (the plan indexes it was computed from) were never compared: edited,
    # they audited AGREE.
    store, db, screen_id, attempt_id, digest = ran
    with sqlite3.connect(db) as connection:
        gate, condition, detail, episodes = connection.execute(
            "SELECT gate, condition, detail, episodes_json FROM verdicts WHERE attempt_id = ? ORDER BY id LIMIT 1",
            (attempt_id,)).fetchone()
    where = "WHERE attempt_id = ? AND gate = ? AND condition = ?"
    edited(db, f"UPDATE verdicts SET detail = ? {where}", detail + " (checked by hand)", attempt_id, gate, condition)
    assert problems(store, screen_id) == [
        f"database verdict {gate}/{condition}/all differs in detail: recomputed [{detail!r}] vs stored "
        f"[{detail + ' (checked by hand)'!r}]"]
    edited(db, f"UPDATE verdicts SET detail = ?, episodes_json = '[]' {where}", detail, attempt_id, gate, condition)
    (line,) = problems(store, screen_id)
    assert line.startswith(f"database verdict {gate}/{condition}/all differs in episodes: recomputed [[")
    assert line.endswith("]] vs stored [[]]")
    edited(db, f"UPDATE verdicts SET episodes_json = ? {where}", episodes, attempt_id, gate, condition)
    agrees_again(store, screen_id, digest)


@pytest.mark.parametrize("table,column,where", [
    ("episodes", "tokens_json", "attempt_id = :attempt AND plan_index = 2"),
    ("verdicts", "episodes_json", "attempt_id = :attempt"),
    ("attempts", "source_freeze", "id = :attempt"),
])
def test_a_json_cell_that_is_not_json_is_one_line_exit_2(ran, packbench_cli, table, column, where):
    # Bug caught: a JSON cell edited into something that is not JSON ended `audit`, `screens show`,
    # `results` and `compare` in a JSONDecodeError traceback, exit 70 ("a packbench bug").
    store, db, screen_id, attempt_id, digest = ran
    with sqlite3.connect(db) as connection:
        (row_id,) = connection.execute(f"SELECT id FROM {table} WHERE {where} ORDER BY id LIMIT 1",
                                       {"attempt": attempt_id}).fetchone()
        connection.execute(f"UPDATE {table} SET {column} = '[1,' WHERE id = ?", (row_id,))
    line = (f"error: the database's {table} row {row_id}: its {column} is not JSON (JSONDecodeError: Expecting value: "
            f"line 1 column 4 (char 3)); it was edited or damaged: put that cell back, or restore the database "
            f"from a backup")
    commands = [("audit", str(screen_id)), ("results", "--screen", str(screen_id))]
    if table != "verdicts":  # compare reads no verdict's episodes
        commands.append(("compare", str(screen_id), str(screen_id)))
    if table == "attempts":
        commands.append(("screens", "show", str(screen_id)))
    for args in commands:
        r = packbench_cli(*args, env={"PACKBENCH_DB_URL": f"sqlite:///{db}"})
        assert (r.returncode, r.stderr.strip()) == (2, line), (args, r.stdout, r.stderr)
    assert [a.result for a in store.audits(attempt_id)] == ["agree"]  # nothing stored was lost or added


def test_an_attempt_naming_a_checkpoint_its_archive_did_not_measure_disagrees(ran):
    # Bug caught: the attempt's `model_sha256` (what `compare` reads to warn that two screens
    # measured different weights) was never compared with the digest worker.json records: a row
    # naming another checkpoint audited AGREE.
    store, db, screen_id, attempt_id, digest = ran
    assert store.latest_attempt(screen_id).model_sha256 is None  # the fake pool's start names no digest
    edited(db, "UPDATE attempts SET model_sha256 = ? WHERE id = ?", "a" * 64, attempt_id)
    assert problems(store, screen_id) == [
        f"worker.json: the checkpoint measured has digest None; the database's attempt says {'a' * 64}"]
    edited(db, "UPDATE attempts SET model_sha256 = NULL WHERE id = ?", attempt_id)
    agrees_again(store, screen_id, digest)


def test_a_row_whose_token_count_or_energy_was_edited_disagrees(ran):
    """Bug caught: `n_tokens` (what `history`'s ms per decode token, a sweep's tokens and
    `compare`'s joules per token divide by) and `energy_j` (`compare`'s joules per episode, `results
    --sort energy_j`) were never compared with the archive: edited, they audited AGREE. A row stored
    before revision 0006 holds NULL energy whatever its record says: NULL is not a disagreement."""
    store, db, screen_id, attempt_id, digest = ran
    with sqlite3.connect(db) as connection:
        (n,) = connection.execute("SELECT n_tokens FROM episodes WHERE attempt_id = ? AND plan_index = 2",
                                  (attempt_id,)).fetchone()
    edited(db, "UPDATE episodes SET n_tokens = n_tokens + 1 WHERE attempt_id = ? AND plan_index = 2", attempt_id)
    assert problems(store, screen_id) == [f"database episode 2 n_tokens {n + 1} != archive {n}"]
    edited(db, "UPDATE episodes SET n_tokens = n_tokens - 1 WHERE attempt_id = ? AND plan_index = 2", attempt_id)
    agrees_again(store, screen_id, digest)
    edited(db, "UPDATE episodes SET energy_j = 12.5 WHERE attempt_id = ? AND plan_index = 2", attempt_id)
    assert problems(store, screen_id) == ["database episode 2 energy_j 12.5 != archive None"]
    edited(db, "UPDATE episodes SET energy_j = NULL WHERE attempt_id = ? AND plan_index = 2", attempt_id)
    agrees_again(store, screen_id, digest)
