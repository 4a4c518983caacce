"""Hostile input at the edges: every numeric option at its extremes (huge integers, inf, nan),
every file argument as a directory, FIFO, device or huge file, a read-only database, a
protocol the model cannot hold. Each case is one line naming the cause, exit 2, no traceback,
nothing queued and no file left behind; a bug, by contrast, exits 70 with its traceback in a file.

Commands run in this process (tests/in_process.py): a FIFO that hung a reader would hang the
test, so each such case runs under a deadline (`within`)."""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
HUGE = str(10**23)  # past SQLite's 64-bit integers and PostgreSQL's


@contextmanager
def within(seconds: int):
    """Fail (instead of hanging the suite) if the block takes longer: a read of a FIFO or of
    /dev/zero that was not bounded would never end."""
    def expired(*_):
        raise TimeoutError(f"still running after {seconds} s: an unbounded read or a hang")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def one_line_error(r, *fragments: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def upgraded(tmp_path_factory) -> Path:
    """An empty database at the newest schema, made once (a migration run costs ~0.3 s)."""
    from packbench.db.store import Store

    path = tmp_path_factory.mktemp("db") / "pb.db"
    with Store(f"sqlite:///{path}") as store:
        store.upgrade()
    return path


@pytest.fixture()
def world(tmp_path, packbench_cli, upgraded):
    """A copy of the upgraded SQLite database in tmp_path, and `pb(*args)` running packbench there."""
    import sqlite3

    db = tmp_path / "pb.db"
    with sqlite3.connect(upgraded) as source, sqlite3.connect(db) as copy:
        source.backup(copy)  # the WAL's pages too
    env = {"PACKBENCH_DB_URL": f"sqlite:///{db}"}

    def pb(*args: str, cwd: Path = tmp_path):
        return packbench_cli(*args, env=env, cwd=cwd)

    return pb


def queued(tmp_path: Path) -> list:
    from packbench.db.store import Store

    with Store(f"sqlite:///{tmp_path / 'pb.db'}") as store:
        return store.list_screens()


def protocol(tmp_path: Path, model: dict, file: str = "p.yaml", **changes) -> Path:
    body = yaml.safe_load((ROOT / "protocols" / "quickstart.yaml").read_text())
    body["model"] = model
    body.update(changes)
    path = tmp_path / file
    path.write_text(yaml.safe_dump(body))
    return path


@pytest.fixture()
def fifo(tmp_path) -> Path:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


@pytest.fixture()
def huge_file(tmp_path) -> Path:
    """A 3 GB sparse file: no disk used, but its size is what a reader sees."""
    path = tmp_path / "huge"
    with open(path, "wb") as f:
        f.truncate(3 << 30)
    return path


# ----------------------------------------------------------------------------- numbers


@pytest.mark.parametrize("args, fragment", [
    (["results", "--screen", HUGE], "no screen with id 100000000000000000000000; ids are at most 2147483647"),
    (["screens", "show", HUGE], "ids are at most 2147483647"),
    (["screens", "cancel", HUGE], "ids are at most 2147483647"),
    (["screens", "retry", HUGE], "ids are at most 2147483647"),
    (["audit", "screen", HUGE], "ids are at most 2147483647"),
    (["report", HUGE], "ids are at most 2147483647"),
    (["compare", HUGE, "1"], "ids are at most 2147483647"),
    (["results", "--limit", HUGE], "'--limit'"),
    (["screens", "list", "--limit", HUGE], "'--limit'"),
    (["screens", "list", "--limit", "-1"], "--limit"),
    (["results", "--min-energy", "nan"], "nan is not a finite number"),
    (["status", "--live-within", "inf"], "inf is not a finite number"),
    (["status", "--live-within", "1e308"], "not a number of seconds in (0, 864000000]"),
    (["status", "--live-within", "0"], "not a number of seconds in (0, 864000000]"),
    (["compare", "1", "2", "--fail-above", "nan"], "--fail-above nan must be"),
    (["dispatch", "--lease", "inf"], "inf is not a finite number"),
    (["dispatch", "--lease", "1e308"], "not a number of seconds"),
    (["dispatch", "--lease", "nan"], "'--lease'"),
    (["--placement-timeout", "nan", "status"], "nan is not a finite number"),
    (["--placement-timeout", "1e308", "status"], "not a number of seconds"),
    (["--connect-timeout", "inf", "status"], "inf is not a finite number"),
    (["--episode-timeout", "0", "status"], "not a number of seconds in (0, 864000000]"),
    (["--episode-timeout", "nan", "status"], "nan is not a finite number"),
    (["--episode-timeout", "1e308", "status"], "not a number of seconds"),
    (["--load-timeout", "-1", "status"], "not a number of seconds in (0, 864000000]"),
    (["--load-timeout", "nan", "status"], "nan is not a finite number"),
    (["--embedded-gpus", HUGE, "status"], "'--embedded-gpus'"),
    (["audit", "reexecute", "1", "--count", HUGE], "'--count'"),
    (["audit", "reexecute", "1", "--seed", HUGE], "'--seed'"),
    (["audit", "screen", "1", "--concurrency", HUGE], "'--concurrency'"),
    (["audit", "screen", "1", "--max-mib", HUGE], "'--max-mib'"),
    (["--db", "", "status"], "is empty; give a database URL"),
])
def test_a_numeric_option_at_its_extreme_is_one_line(world, args, fragment):
    """Each of these was an OverflowError or ValueError traceback (SQLite's driver, timedelta,
    Settings), or ran on with a value no database can hold."""
    one_line_error(world(*args), fragment)


def test_submit_priority_and_attempts_beyond_the_database_queue_nothing(tmp_path, world, tiny):
    p = protocol(tmp_path, {"path": str(tiny)})
    for option in ("--priority", "--max-attempts"):
        one_line_error(world("submit", str(p), option, HUGE), f"'{option}'", "2147483647")
    one_line_error(world("submit", str(p), "--priority", str(-10**23)), "'--priority'")
    one_line_error(world("submit", str(p), "--keep-queued"), "--keep-queued", "without --wait", "add --wait")
    assert queued(tmp_path) == []
    assert world("submit", str(p), "--priority", str(2**31 - 1)).returncode == 0  # the largest the column holds
    from packbench.db.store import Store

    with Store(f"sqlite:///{tmp_path / 'pb.db'}") as store:
        assert store.screen(1).priority == 2**31 - 1


def test_model_synth_with_a_huge_seed_leaves_no_out_directory(tmp_path, world):
    out = tmp_path / "model"
    one_line_error(world("model", "synth", "--out", str(out), "--seed", HUGE), "--seed", "9223372036854775807")
    assert not out.exists()


def test_a_protocol_synth_seed_beyond_torch_is_refused_at_validation(tmp_path, world):
    p = protocol(tmp_path, {"synth": {"shape": "tiny", "dtype": "float32", "sparsity": 0.94, "seed": 2**64}})
    one_line_error(world("protocol", "validate", str(p)), "model.synth.seed", "9223372036854775807")


# ----------------------------------------------------------------------------- an unexpected error


def test_an_unexpected_error_exits_70_with_its_traceback_in_a_file(world, monkeypatch):
    """A bug is not bad input: not exit 2, not a traceback on the terminal, but one line saying
    where the traceback went."""
    import packbench.db.store

    def broken(self, *args, **kwargs):
        raise RuntimeError("a bug\nspanning lines")

    monkeypatch.setattr(packbench.db.store.Store, "list_screens", broken)
    r = world("screens", "list")
    assert r.returncode == 70, (r.returncode, r.stderr)
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error: unexpected RuntimeError: a bug\\nspanning lines (traceback in ") and "bug" in line
    where = Path(line.split("(traceback in ", 1)[1].split(")", 1)[0])
    try:
        text = where.read_text()
        assert "Traceback (most recent call last)" in text and "RuntimeError: a bug" in text and "screens list" in text
    finally:
        where.unlink()
    r = world("--debug", "screens", "list")  # --debug: the traceback on the terminal too
    assert r.returncode == 70 and "Traceback (most recent call last)" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: unexpected RuntimeError")
    Path(r.stderr.split("(traceback in ", 1)[1].split(")", 1)[0]).unlink()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_stdout_on_a_full_disk_is_one_line_not_a_bug(world, tmp_path):
    """`screens list > out.txt` on a full disk (stdout on /dev/full) said 'unexpected OSError ...
    this is a packbench bug' and exited 70: the output's place refused it. One line, exit 2, and no
    'Exception ignored' from the interpreter's own flush at exit."""
    import subprocess
    import sys

    assert world("screens", "list").returncode == 0  # the database exists: the write is what fails
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "packbench", "screens", "list", "--json"], stdout=full,
                           stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                           env={**os.environ, "PACKBENCH_DB_URL": f"sqlite:///{tmp_path / 'pb.db'}"})
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.strip().splitlines() == ["error: cannot write the output to stdout (No space left on device); "
                                             "free space where stdout goes, or send it elsewhere"], r.stderr


@pytest.mark.parametrize("args", [["screens", "list", "--json"], ["db", "history"], ["--version"]])
def test_a_closed_stdout_is_one_line_not_a_bug(world, tmp_path, args):
    """`packbench screens list >&-` (descriptor 1 closed: the interpreter's sys.stdout is None)
    said 'unexpected AttributeError: 'NoneType' object has no attribute 'write' ... this is a
    packbench bug' and exited 70. One line naming the closed stdout and the fix, exit 2."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "packbench", *args], stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True, cwd=tmp_path, preexec_fn=lambda: os.close(1),
                       env={**os.environ, "PACKBENCH_DB_URL": f"sqlite:///{tmp_path / 'pb.db'}"})
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.strip().splitlines() == ["error: cannot write the output to stdout (Bad file descriptor); stdout "
                                             "is closed: give the command one, e.g. `> out.txt` or `> /dev/null`"], \
        r.stderr


# ----------------------------------------------------------------------------- file arguments


@pytest.mark.parametrize("kind", ["directory", "fifo", "device", "huge", "empty", "a list"])
def test_a_protocol_path_that_is_no_protocol_file_is_one_line(tmp_path, world, fifo, huge_file, kind):
    path = {"directory": tmp_path, "fifo": fifo, "device": Path("/dev/zero"), "huge": huge_file,
            "empty": tmp_path / "empty.yaml", "a list": tmp_path / "list.yaml"}[kind]
    (tmp_path / "empty.yaml").write_text("# nothing here\n")
    (tmp_path / "list.yaml").write_text("- name: q\n")
    expected = {"directory": "is a directory, not a regular file", "fifo": "is a FIFO (named pipe), not a regular file",
                "device": "is a device, not a regular file", "huge": "is 3221225472 bytes; a protocol file is at most",
                "empty": "holds no protocol (it is empty or only comments)",
                "a list": "holds a YAML list, not a protocol"}[kind]
    for command in (["protocol", "validate"], ["protocol", "show"], ["submit"]):
        with within(10):
            one_line_error(world(*command, str(path)), expected)
    assert queued(tmp_path) == []


@pytest.mark.parametrize("source", ["token_file", "text_file"])
@pytest.mark.parametrize("kind", ["directory", "fifo", "device", "huge"])
def test_a_prompt_file_that_is_no_regular_file_is_refused_before_it_is_read(tmp_path, world, tiny, fifo, huge_file,
                                                                            source, kind):
    """/dev/zero grew validate to 10.7 GB in 20 s; a FIFO hung it; a 3 GB file took 18 s."""
    path = {"directory": tmp_path, "fifo": fifo, "device": Path("/dev/zero"), "huge": huge_file}[kind]
    p = protocol(tmp_path, {"path": str(tiny)}, prompts={source: str(path)})
    expected = {"directory": "is a directory", "fifo": "is a FIFO (named pipe)", "device": "is a device",
                "huge": "is 3221225472 bytes, more than the 64 MiB limit"}[kind]
    with within(10):
        one_line_error(world("protocol", "validate", str(p)), f"`prompts.{source}`", expected)


def test_read_bounded_stops_at_its_limit_for_a_file_that_says_0_bytes():
    """/proc files say 0 bytes and hold more: the read itself is bounded, not only the size."""
    from packbench.core.files import NotReadable, read_bounded

    with pytest.raises(NotReadable, match="holds more than the 16 bytes limit"):
        read_bounded(Path("/proc/self/status"), limit=16)
    assert read_bounded(Path("/proc/self/status"), limit=1 << 20).startswith(b"Name:")


@pytest.mark.parametrize("kind", ["directory", "fifo", "device", "text"])
def test_an_archive_argument_that_is_no_archive_is_one_line(tmp_path, world, fifo, kind):
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    path = {"directory": tmp_path, "fifo": fifo, "device": Path("/dev/zero"), "text": text}[kind]
    for command in (["audit", "archive"], ["report"]):
        with within(10):
            r = world(*command, str(path))
        one_line_error(r, "is not a readable zip archive" if kind == "text" else "not an archive file")
        assert r.stdout == "", r.stdout  # no empty verdict table before the line


# ----------------------------------------------------------------------------- the model


@pytest.fixture()
def model_paths(tmp_path) -> dict[str, Path]:
    (tmp_path / "a-file").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (tmp_path / "no-config").mkdir()
    return {"missing": tmp_path / "nonexistent", "a file": tmp_path / "a-file", "no config": tmp_path / "no-config"}


@pytest.mark.parametrize("kind, fragment", [
    ("missing", "does not exist; create one with `packbench model synth"),
    ("a file", "is not a directory; point model.path at a Hugging Face OPT checkpoint directory"),
    ("no config", "is a directory without config.json, not a model checkpoint"),
])
def test_protocol_validate_checks_the_model_path_and_says_what_it_is(tmp_path, world, model_paths, kind, fragment):
    p = protocol(tmp_path, {"path": str(model_paths[kind])})
    line = one_line_error(world("protocol", "validate", str(p)), fragment)
    if kind == "a file":
        assert "model synth" not in line  # never the advice to synthesise over an existing file


def test_an_episode_beyond_the_models_positions_is_refused_before_anything_runs(tmp_path, world, tiny):
    """prefix 250 + 8 continuation tokens need 257 positions; the tiny model has 256. This passed
    validate and plan, and submit --wait ran every episode into an IndexError."""
    p = protocol(tmp_path, {"path": str(tiny)}, prefix_tokens=250, continuation_tokens=8)
    expected = ("prefix_tokens 250 + continuation_tokens 8 - 1 = 257 positions, but checkpoint", "has 256")
    one_line_error(world("protocol", "validate", str(p)), *expected)
    one_line_error(world("protocol", "plan", str(p), "--sparsity", "0.94"), *expected)
    one_line_error(world("submit", str(p)), *expected)
    assert queued(tmp_path) == []
    fits = protocol(tmp_path, {"path": str(tiny)}, "fits.yaml", prefix_tokens=249, continuation_tokens=8)
    assert world("protocol", "validate", str(fits)).returncode == 0
    synth = protocol(tmp_path, {"synth": {"shape": "tiny", "dtype": "float32", "sparsity": 0.94, "seed": 0}}, "synth.yaml",
                     prefix_tokens=250, continuation_tokens=8)
    one_line_error(world("protocol", "validate", str(synth)), "but the synthetic tiny shape has 256")
    one_line_error(world("protocol", "plan", str(p), "--shape", "tiny", "--sparsity", "0.94"), "257 positions")


def test_model_stats_defaults_fit_the_tiny_model_and_its_extremes_are_one_line(tmp_path, world, tiny, fifo):
    """The demo's own model with default options was an 80-line IndexError (prefix 512 > 256).
    The default is cut to the positions (checked on the pure function: a measurement costs the
    import of transformers' OPT, seconds on CI); an explicit one that does not fit is refused."""
    from packbench.cli.model_stats import _prefix

    assert _prefix(None, continuation=16, positions=256) == 241  # 241 + 16 - 1 = 256: the tiny model's all
    assert _prefix(None, continuation=16, positions=2048) == 512  # a real OPT's: the default as it was
    assert _prefix(249, continuation=8, positions=256) == 249
    one_line_error(world("model", "stats", str(tiny), "--prefix", "1000"), "--prefix 1000 + --continuation 16 - 1",
                   "the model has 256")
    one_line_error(world("model", "stats", str(tiny), "--count", HUGE), "'--count'")
    one_line_error(world("model", "stats", str(tiny), "--count", "99999999999"), "'--count'")
    one_line_error(world("model", "stats", str(tiny), "--seed", HUGE), "'--seed'")
    for path, what in ((Path("/dev/zero"), "is a device"), (fifo, "is a FIFO"), (tmp_path, "is a directory")):
        with within(10):
            one_line_error(world("model", "stats", str(tiny), "--prompts", str(path)), "--prompts", what)


def test_model_digest_of_a_directory_without_config_is_refused(tmp_path, world, model_paths):
    one_line_error(world("model", "digest", str(model_paths["no config"])), "without config.json")


# ----------------------------------------------------------------------------- names


@pytest.mark.parametrize("name, fragment", [
    ("q\x00evil", "holds a NUL character"),
    ("x" * (1 << 20), "1048576 characters, more than 200"),
], ids=["nul", "a-megabyte"])
def test_a_protocol_name_with_nul_or_a_megabyte_is_refused_on_sqlite_too(tmp_path, world, tiny, name, fragment):
    p = protocol(tmp_path, {"path": str(tiny)}, name=name)
    one_line_error(world("submit", str(p)), "protocol field `name`", fragment)
    assert queued(tmp_path) == []


def test_labels_with_nul_are_refused_on_sqlite_too(tmp_path, world, tiny):
    from packbench.core.errors import PackbenchError
    from packbench.db.store import Store

    assert world("submit", str(protocol(tmp_path, {"path": str(tiny)}))).returncode == 0
    with Store(f"sqlite:///{tmp_path / 'pb.db'}") as store:
        for labels in ({"name": "a\x00b"}, {"note": "a\x00b"}, {"tags": {"k": "a\x00b"}}):
            with pytest.raises(PackbenchError, match="NUL"):
                store.label_screen(1, **labels)
        assert store.screen(1).name is None


# ----------------------------------------------------------------------------- the database


def test_results_in_an_empty_folder_leaves_no_database_file(tmp_path, packbench_cli):
    r = packbench_cli("results", env={"PACKBENCH_DB_URL": ""}, cwd=tmp_path)
    one_line_error(r, "no database at packbench.db", "packbench db upgrade")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("url, fragment", [
    ("postgresql://h:abc/x", "cannot parse database URL"),  # make_url's ValueError: exit 70
    ("postgresql://u:secret@[::1/x", "cannot parse database URL 'postgresql://u:***@"),
    ("sqlite:///x.db?foo=bar", "SQLite's driver does not read 'foo'"),  # three lines of SAWarning, an empty x.db
    ("sqlite:///x.db?mode=ro", "SQLite's driver does not read 'mode'"),
    ("sqlite:///x.db?timeout=5", "no database at x.db"),  # a driver argument: the file must still exist
])
def test_a_database_url_that_cannot_be_used_is_one_line_and_creates_no_file(tmp_path, packbench_cli, url, fragment):
    """Catches a --db URL with a port that is no number (exit 70), and a SQLite URL with a query:
    the missing-file check was skipped for any query, so `status` created an empty x.db beside it,
    and an argument the driver does not read printed its three-line warning."""
    one_line_error(packbench_cli("status", "--db", url, cwd=tmp_path), fragment)
    assert list(tmp_path.iterdir()) == []


def test_db_current_and_history_of_a_missing_file_create_no_database(tmp_path, packbench_cli):
    """`db current` left an empty packbench.db behind (then said `empty`), `db history` too."""
    env = {"PACKBENCH_DB_URL": ""}
    one_line_error(packbench_cli("db", "current", env=env, cwd=tmp_path), "no database at packbench.db",
                   "packbench db upgrade")
    from packbench.db.store import Store

    r = packbench_cli("db", "history", env=env, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith(f"{Store.head()}: "), (r.stdout, r.stderr)
    assert list(tmp_path.iterdir()) == []


def test_a_read_only_sqlite_database_is_read_by_status_and_results(tmp_path, world, tiny, monkeypatch):
    """On a read-only mount SQLite cannot create the WAL's -shm file, so even a read failed. Stood
    in for here by a directory where -shm goes (SQLite cannot create it either) and a file system
    that says it is not writable."""
    import packbench.db.session

    import sqlite3

    assert world("submit", str(protocol(tmp_path, {"path": str(tiny)}))).returncode == 0
    with sqlite3.connect(tmp_path / "pb.db") as c:  # the WAL's rows into the file, as a clean shutdown leaves it
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    (tmp_path / "pb.db-shm").unlink(missing_ok=True)
    (tmp_path / "pb.db-wal").unlink(missing_ok=True)
    (tmp_path / "pb.db-shm").mkdir()
    real_access = os.access
    monkeypatch.setattr(packbench.db.session.os, "access",
                        lambda path, mode: False if mode & os.W_OK else real_access(path, mode))
    r = world("screens", "list")
    assert r.returncode == 0 and "quickstart" in r.stdout, (r.stdout, r.stderr)
    assert world("status").returncode == 0
    assert world("results", "--screen", "1").returncode == 0
    one_line_error(world("screens", "cancel", "1"), "is read-only", "make the file and its directory writable")


def test_postgresql_errors_that_are_not_the_schema_do_not_advise_an_upgrade():
    """A NUL in text, an integer out of range and a read-only transaction said "or run
    `packbench db upgrade`"; only a schema-like error does now."""
    import psycopg
    import psycopg.errors
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import DataError, InternalError, ProgrammingError

    from packbench.db.session import translate

    url = make_url("postgresql+psycopg://u@db:5432/x")
    nul = translate(DataError("INSERT", {}, psycopg.DataError("PostgreSQL text fields cannot contain NUL (0x00) "
                                                              "bytes")), url)
    out_of_range = translate(DataError("SELECT", {}, psycopg.errors.NumericValueOutOfRange("integer out of range")),
                             url)
    read_only = translate(InternalError("INSERT", {}, psycopg.errors.ReadOnlySqlTransaction(
        "cannot execute INSERT in a read-only transaction")), url)
    for e in (nul, out_of_range, read_only):
        assert "db upgrade" not in str(e), str(e)
    assert "cannot store a value it was given" in str(nul) and "NUL" in str(nul)
    assert "integer out of range" in str(out_of_range)
    assert "accepts no writes here" in str(read_only)
    schema = translate(ProgrammingError("SELECT", {}, psycopg.errors.InsufficientPrivilege("permission denied")), url)
    assert "db upgrade" in str(schema)


# ----------------------------------------------------------------------------- words


def test_help_shows_no_value_beside_a_flag(packbench_cli):
    r = packbench_cli("submit", "--help", env={"COLUMNS": "200"})
    assert r.returncode == 0
    wait = next(line for line in r.stdout.splitlines() if "--wait" in line and "Run the screen" in line)
    assert "<bool>" not in wait, wait


@pytest.mark.parametrize("columns", ["99999999999999999999", "0", "10001"])
def test_help_at_a_terminal_width_it_cannot_draw_is_drawn_at_the_default(packbench_cli, columns):
    """COLUMNS=99999999999999999999 made `packbench --help` an OverflowError in rich (exit 70), 0 a
    blank page, 100,000 3.9 MB of padding: a width outside 1..10,000 is dropped, as if unset."""
    r = packbench_cli("submit", "--help", env={"COLUMNS": columns})
    default = packbench_cli("submit", "--help", env={"COLUMNS": "80"})
    assert (r.returncode, r.stderr) == (0, ""), r.stderr
    assert r.stdout == default.stdout and "Freeze a protocol" in r.stdout
    assert packbench_cli(env={"COLUMNS": columns}).returncode == 2  # the bare command's help, as typer shows it
    assert packbench_cli("submit", "--help", env={"COLUMNS": "10000"}).stdout != default.stdout  # the bound: used


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_a_key_file_that_is_no_regular_file_is_refused_before_anything_is_queued(tmp_path, world, tiny, fifo, kind):
    """A FIFO as --signing-key or --trust hung the command; /dev/zero read without end; and a
    `submit --wait` with an unreadable key queued its screen first and left it queued."""
    path = {"fifo": fifo, "device": Path("/dev/zero"), "directory": tmp_path}[kind]
    what = {"fifo": "is a FIFO (named pipe)", "device": "is a device", "directory": "is a directory"}[kind]
    p = protocol(tmp_path, {"path": str(tiny)})
    with within(10):
        one_line_error(world("--signing-key", str(path), "submit", str(p), "--wait"), what, "signing key")
    assert queued(tmp_path) == []
    (tmp_path / "notes.txt").write_text("hello\n")
    with within(10):
        one_line_error(world("audit", "archive", str(tmp_path / "notes.txt"), "--trust", str(path)), what,
                       "public key")


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o602], ids=lambda m: f"{m:04o}")
def test_a_signing_key_others_may_read_or_write_is_refused_as_ssh_does(tmp_path, world, tiny, mode):
    """A private signing key readable (or writable) by its group or others was loaded silently by
    `dispatch` and `submit --wait`: anyone who could read it could sign as this deployment. Now
    one line names the file, its mode and `chmod 600 FILE`, before anything is queued or claimed;
    after the chmod the key loads."""
    from packbench.core.provenance import Signer, generate_key

    key = generate_key(tmp_path / "lab.pem")[0]
    os.chmod(key, mode)
    fix = f"has mode {mode:04o}: its group or others may read or write it, so it is not private; run `chmod 600 {key}`"
    p = protocol(tmp_path, {"path": str(tiny)})
    one_line_error(world("--signing-key", str(key), "submit", str(p), "--wait"), f"the signing key {key} {fix}")
    assert queued(tmp_path) == []
    one_line_error(world("--signing-key", str(key), "dispatch", "--archive-dir", str(tmp_path / "a")), fix)
    os.chmod(key, 0o600)
    assert Signer.load(key).key_id


def test_keys_init_writes_a_private_key_only_its_owner_reads(tmp_path, world):
    """`keys init` writes the private key 0600 whatever the umask (the dispatcher refuses any
    other), so a key it made is never refused."""
    old = os.umask(0)
    try:
        assert world("keys", "init", "--key", str(tmp_path / "k.pem"), "--no-db").returncode == 0
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "k.pem").st_mode & 0o777 == 0o600


# ----------------------------------------------------------------------------- every numeric option


def cli_parameters() -> list[tuple[tuple[str, ...], object]]:
    """(command path, click parameter) of every parameter packbench's app has, the root's
    options (path ()) included, read from the app itself."""
    import typer

    from packbench.cli.main import app

    def walk(command, path):
        if hasattr(command, "commands"):
            for name, sub in command.commands.items():
                yield from walk(sub, (*path, name))
            return
        yield from ((path, p) for p in command.params)

    root = typer.main.get_command(app)
    return [((), p) for p in root.params] + list(walk(root, ()))


def annotation(p) -> object:
    return getattr(getattr(p, "type_descriptor", None), "annotation", None)


def numeric_options() -> list[tuple[tuple[str, ...], str, str]]:
    """(command path, option, 'int' or 'float') of every numeric option packbench has, read from
    the app itself: an option added later is probed without anyone listing it here."""
    return [(path, p.opts[0], annotation(p).__name__) for path, p in cli_parameters()
            if annotation(p) in (int, float) and p.opts and p.opts[0].startswith("--")]


# 0, -1 and 2**63 (one past a signed 64-bit integer) as well as the far extremes: a bound that is
# off by one, or checked only for huge values, shows at these.
EXTREMES = {"int": ["0", "-1", str(2**63), str(10**23), str(-10**23)],
            "float": ["0", "-1", str(2**63), "inf", "-inf", "nan", "1e308", "-1e308"]}
NEEDS = {  # the arguments each command needs besides the option (files made by the test)
    ("submit",): ["p.yaml"], ("compare",): ["1", "2"], ("history",): ["quickstart"],
    ("model", "synth"): ["--out", "out"], ("model", "stats"): ["TINY"], ("protocol", "plan"): ["p.yaml"],
    ("audit", "archive"): ["notes.txt"], ("audit", "screen"): ["1"], ("audit", "reexecute"): ["1"],
}


@pytest.mark.parametrize("path, option, kind", numeric_options(), ids=lambda v: " ".join(v) if isinstance(v, tuple)
                         else str(v))
def test_every_numeric_option_at_its_extremes_is_refused_or_used_never_a_traceback(tmp_path, world, tiny, path,
                                                                                   option, kind):
    """0, -1, 2**63, huge integers, inf, nan and 1e308 in every numeric option: exit 0 (a value it
    can use) or one line and exit 2, never a traceback (70) and never a command that runs on; a
    refused value queues nothing."""
    protocol(tmp_path, {"path": str(tiny)})
    (tmp_path / "notes.txt").write_text("hello\n")
    needs = [str(tiny) if a == "TINY" else a for a in NEEDS.get(path, [])]
    for value in EXTREMES[kind]:
        args = [option, value, "screens", "list"] if not path else [*path, *needs, option, value]
        before = len(queued(tmp_path))
        with within(20):
            r = world(*args)
        assert r.returncode in (0, 2), (args, r.returncode, r.stderr)
        if r.returncode == 2:
            lines = r.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stderr, (args, r.stderr)
            assert len(queued(tmp_path)) == before, args  # a refused value queued a screen


# ----------------------------------------------------------------------------- every file argument


ARCHIVE = ROOT / "tests" / "data" / "quickstart-v1.zip"
FILE_ARGS = {  # (command, parameter) -> the command line with F where the hostile path goes
    (("submit",), "protocol"): ["submit", "F"],
    (("ingest",), "archive"): ["ingest", "F", "--trust", "F"],
    (("ingest",), "--trust"): ["ingest", str(ARCHIVE), "--trust", "F"],
    (("report",), "--out"): ["report", str(ARCHIVE), "--out", "F"],
    (("history",), "--html"): ["history", "quickstart", "--html", "F"],
    (("model", "synth"), "--out"): ["model", "synth", "--out", "F"],
    (("model", "digest"), "model_dir"): ["model", "digest", "F"],
    (("model", "stats"), "model_dir"): ["model", "stats", "F"],
    (("model", "stats"), "--prompts"): ["model", "stats", "TINY", "--prompts", "F"],
    (("model", "stats"), "--trace"): ["model", "stats", "TINY", "--trace", "F"],
    (("simulate",), "trace"): ["simulate", "F"],
    (("protocol", "validate"), "protocol"): ["protocol", "validate", "F"],
    (("protocol", "show"), "protocol"): ["protocol", "show", "F"],
    (("protocol", "plan"), "protocol"): ["protocol", "plan", "F"],
    (("keys", "init"), "--key"): ["keys", "init", "--no-db", "--key", "F"],
    (("keys", "register"), "public_key"): ["keys", "register", "--name", "x", "F"],
    (("audit", "archive"), "files"): ["audit", "archive", "F"],
    (("audit", "archive"), "--trust"): ["audit", "archive", str(ARCHIVE), "--trust", "F"],
    (("audit", "screen"), "--archive"): ["audit", "screen", "--archive", "F"],
    (("audit", "reexecute"), "--archive"): ["audit", "reexecute", "--archive", "F"],
    (("audit", "reexecute"), "--model-dir"): ["audit", "reexecute", "--archive", str(ARCHIVE), "--model-dir", "F"],
    (("audit", "reexecute"), "--trust"): ["audit", "reexecute", "--archive", str(ARCHIVE), "--trust", "F"],
}
# Directories to write into, read by a worker, or checked by their own tests (test_hostile_input.py
# for --archive-dir, the key test above for --signing-key); model stats --figure is an SVG written,
# never read (tests/cli/test_model_moe.py).
NOT_READ_HERE = {((), "--model-cache"), ((), "--signing-key"), (("submit",), "--archive-dir"),
                 (("dispatch",), "--archive-dir"), (("model", "stats"), "--figure")}


def file_parameters() -> set[tuple[tuple[str, ...], str]]:
    return {(path, p.opts[0] if p.opts and p.opts[0].startswith("--") else p.name)
            for path, p in cli_parameters() if "Path" in str(annotation(p) or "")}


def test_every_file_parameter_is_probed():
    """A file argument added later must join FILE_ARGS (or say why not)."""
    assert file_parameters() == set(FILE_ARGS) | NOT_READ_HERE


@pytest.mark.parametrize("key", sorted(FILE_ARGS), ids=lambda k: " ".join([*k[0], k[1]]))
def test_every_file_argument_as_a_directory_fifo_device_or_huge_file_is_one_line(tmp_path, world, tiny, fifo,
                                                                                  huge_file, key):
    """Never a hang (a FIFO), an endless read (/dev/zero) or a traceback: a path that is no
    file of the kind is one line, exit 2 (a directory where one is wanted is used: exit 0)."""
    (tmp_path / "adir").mkdir()
    for path in (tmp_path / "adir", fifo, Path("/dev/zero"), huge_file):
        args = [str(path) if a == "F" else str(tiny) if a == "TINY" else a for a in FILE_ARGS[key]]
        with within(20):
            r = world(*args)
        assert r.returncode in (0, 2), (args, r.returncode, r.stderr)
        if r.returncode == 2:
            lines = r.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stderr, (args, r.stderr)
    assert queued(tmp_path) == []


LONG_NAME_ARGS = [  # paths that are no Path parameter, or are written into, with the too-long name at F
    ["report", "F"], ["dispatch", "--archive-dir", "F"], ["submit", "p.yaml", "--wait", "--archive-dir", "F"],
    ["--db", "sqlite:///F", "screens", "list"],
]


@pytest.mark.parametrize("args", [*FILE_ARGS.values(), *LONG_NAME_ARGS], ids=lambda a: " ".join(a))
def test_a_path_with_a_name_longer_than_the_file_system_allows_is_one_line(tmp_path, world, tiny, args):
    """Was exit 70 ("unexpected OSError: [Errno 36] File name too long", a packbench bug) from
    report, ingest, submit, protocol validate/plan/show, model stats/synth/digest, dispatch
    --archive-dir and --db sqlite:///...: a 300-character file name is bad input."""
    protocol(tmp_path, {"path": str(tiny)})
    long = tmp_path / ("y" * 300 + ".html")
    args = [a.replace("F", str(long)) if "F" in a and a != "--db" else str(tiny) if a == "TINY" else a for a in args]
    r = world(*args)
    assert r.returncode in (0, 2), (args, r.returncode, r.stderr)
    if r.returncode == 2:  # model stats --trace prints its progress first: the error is the last line
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and len(last) < 500 and "Traceback" not in r.stderr, (args, r.stderr)
    assert queued(tmp_path) == []


# ----------------------------------------------------------------------------- read-only output folders


@pytest.fixture()
def read_only(monkeypatch):
    """`read_only(folder)`: from now on the file system refuses to create files in `folder`, as
    a read-only mount does (EROFS), for the probe write that packbench makes before it starts
    work there. Root ignores permission bits, so a chmod would not stand in for it; a real
    read-only bind mount was probed by hand (`mount -o remount,ro,bind`) with the same lines."""
    import errno
    import tempfile

    refused: set[Path] = set()
    real = tempfile.TemporaryFile

    def temporary_file(*args, dir=None, **kwargs):
        if dir is not None and Path(dir).resolve() in refused:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "TemporaryFile", temporary_file)
    return lambda folder: refused.add(Path(folder).resolve())


def test_model_synth_into_a_read_only_folder_is_one_line_before_any_weight_is_drawn(tmp_path, world, read_only):
    """Was exit 70: safetensors' own SafetensorError ("I/O error: Read-only file system") after the
    weights were drawn, for an --out that exists on a read-only mount."""
    out = tmp_path / "ro"
    out.mkdir()
    read_only(out)
    one_line_error(world("model", "synth", "--shape", "tiny", "--out", str(out)), f"--out {out}: cannot write into "
                   "that directory (Read-only file system); give --out a writable directory")
    assert list(out.iterdir()) == []


def test_safetensors_write_errors_are_raised_as_os_errors():
    """engine/synth.py os_errors: what lets `model synth` say a full disk in one line (exit 2, not 70)."""
    import errno

    from safetensors import SafetensorError

    from packbench.engine.synth import os_errors

    with pytest.raises(OSError) as caught, os_errors():
        raise SafetensorError('Error while serializing: I/O error: No space left on device (os error 28) at path "x"')
    assert caught.value.errno == errno.ENOSPC and caught.value.strerror == os.strerror(errno.ENOSPC)
    with pytest.raises(SafetensorError), os_errors():  # not an I/O error: left as it is (a bug is not bad input)
        raise SafetensorError("invalid dtype")


def test_a_read_only_archive_dir_queues_and_claims_nothing(tmp_path, world, tiny, read_only):
    """`submit --wait --archive-dir RO` queued the screen, started Ray, spent an attempt and exited
    74 with the screen left queued; `dispatch` spent an attempt of the screen it claimed."""
    archives = tmp_path / "ro-archives"
    archives.mkdir()
    read_only(archives)
    p = protocol(tmp_path, {"path": str(tiny)})
    expected = f"--archive-dir {archives}: cannot write into that directory (Read-only file system)"
    one_line_error(world("submit", str(p), "--wait", "--archive-dir", str(archives)), expected)
    assert queued(tmp_path) == []
    assert world("submit", str(p)).returncode == 0
    one_line_error(world("dispatch", "--archive-dir", str(archives)), expected)
    from packbench.db.store import Store

    with Store(f"sqlite:///{tmp_path / 'pb.db'}") as store:
        (screen,) = store.list_screens()
        assert screen.status == "queued" and store.attempts(screen.id) == []  # no attempt spent


def test_model_stats_refuses_sampled_without_robustness(world, tiny):
    """--sampled 0, -1 or 2**63 without --robustness was ignored (exit 0 after a full measurement)."""
    for value in ("0", "-1", str(2**63), "64"):
        one_line_error(world("model", "stats", str(tiny), "--sampled", value), f"--sampled {value} is the text "
                       "--robustness scores; without --robustness nothing is sampled")
    one_line_error(world("model", "stats", str(tiny), "--robustness", "--sampled", "0"), "--sampled 0 must be in 1..2048")


def test_a_condition_name_is_bounded_and_so_is_every_error_line_naming_conditions(tmp_path, world, tiny):
    """A 100,000-character condition name validated (then stored in every episode row), and a
    reference outside the conditions printed every name whole: a 100 KB error line."""
    dense = {"name": "d" * 201, "policy": "dense-stream"}
    p = protocol(tmp_path, {"path": str(tiny)}, conditions=[dense, {"name": "packet", "policy": "packet"}],
                 reference="d" * 201)
    one_line_error(world("protocol", "validate", str(p)), "conditions[0].name", "201 characters, more than 200")
    long = [{"name": f"{i:02d}" + "c" * 198, "policy": "packet"} for i in range(16)]
    p = protocol(tmp_path, {"path": str(tiny)}, conditions=long, reference="nope", gates={"faithfulness": {}})
    line = one_line_error(world("protocol", "validate", str(p)), "`reference`", "is not allowed; use one of")
    assert len(line) < 16 * 80, len(line)  # each name shown to 60 characters, not whole
