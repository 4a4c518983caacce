"""Bad URLs and unusable databases fail with one line that names the cause and the fix."""

from __future__ import annotations


import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from packbench.core.errors import PackbenchError
from packbench.db.errors import DatabaseError, SchemaNotAtHead
from packbench.db.session import ENV_VAR, default_url, make_engine
from packbench.db.store import Store


def error_of(call) -> str:
    """Run `call`, expect a DatabaseError, return its message after checking it is one line."""
    with pytest.raises(DatabaseError) as info:
        call()
    message = str(info.value)
    assert isinstance(info.value, PackbenchError)
    assert message.strip() and "\n" not in message, repr(message)
    return message


def test_default_url_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert default_url() == "sqlite:///packbench.db"
    monkeypatch.setenv(ENV_VAR, "postgresql+psycopg://u@db:5432/pb")
    assert default_url() == "postgresql+psycopg://u@db:5432/pb"
    assert Store().dialect == "postgresql"  # no connection is made until first use


@pytest.mark.parametrize("url", ["foo://x", "mysql://u@h/db", "not a url"])
def test_unsupported_or_malformed_url(url):
    message = error_of(lambda: Store(url))
    assert ENV_VAR in message and "sqlite:///" in message


def test_bare_postgresql_url_uses_psycopg():
    store = Store("postgresql://postgres@127.0.0.1:1/test")
    assert store.dialect == "postgresql"
    assert "+psycopg" in store.url


def test_postgres_server_not_listening():
    store = Store("postgresql+psycopg://postgres:s3cret@127.0.0.1:1/test")
    message = error_of(store.current)
    assert message == (
        "cannot connect to postgresql at 127.0.0.1:1 (connection refused); "
        f"start the server or set {ENV_VAR}"
    )
    # Data methods go through the same translation (via the schema check).
    assert error_of(store.queued_screens) == message
    assert "s3cret" not in store.url


@pytest.mark.parametrize(("url", "said"), [
    ("postgresql+psycopg://postgres@127.0.0.1:5432/test?sslmode=Bogus", 'invalid sslmode value: "Bogus"'),
    ("postgresql+psycopg://postgres@127.0.0.1:99999/test", 'invalid port number: "99999"'),
])
def test_a_connection_option_libpq_refuses_is_bad_input_not_an_outage(url, said):
    """Bug caught: a URL option libpq refuses before asking any server (`?sslmode=Bogus`, port
    99999) was read as an outage: "check that the server is up and reachable, then retry", and
    `DatabaseUnavailable`, which a write retries for 13 s and `dispatch --follow` waits out. It
    now names the option and says to fix it in the URL, and is not transient."""
    from packbench.db.errors import DatabaseUnavailable

    with pytest.raises(DatabaseError) as info:
        Store(url).current()
    assert not isinstance(info.value, DatabaseUnavailable)
    where = "127.0.0.1:99999" if ":99999" in url else "127.0.0.1:5432"
    assert str(info.value) == f"cannot connect to postgresql at {where} ({said}); fix it in {ENV_VAR}"


def test_postgres_unknown_role_and_database(pg_server_url):
    base = make_url(pg_server_url)
    message = error_of(Store(base.set(username="pb_no_such_role")).current)
    assert "pb_no_such_role" in message and ENV_VAR in message
    message = error_of(Store(base.set(database="pb_no_such_database")).current)
    assert "createdb pb_no_such_database" in message


def test_sqlite_directory_missing(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'missing' / 'packbench.db'}")
    message = error_of(store.upgrade)
    assert "create its directory" in message and ENV_VAR in message


def test_sqlite_opened_read_only(tmp_path):
    """A database opened read-only (here through SQLite's URI mode=ro) refuses writes clearly."""
    path = tmp_path / "packbench.db"
    with Store(f"sqlite:///{path}") as store:
        store.upgrade()
    with Store(f"sqlite:///file:{path}?mode=ro&uri=true") as store:
        store.check_head()  # reading still works
        message = error_of(lambda: store.put_protocol(sha256="a" * 64, name="x", canonical_json="{}"))
    assert "read-only" in message and "writable" in message and ENV_VAR in message


def test_sqlite_file_that_is_not_a_database(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello, this is not SQLite\n" * 100)
    message = error_of(Store(f"sqlite:///{path}").current)
    assert "not a SQLite database" in message


def test_schema_errors_are_database_errors():
    assert issubclass(SchemaNotAtHead, DatabaseError)


def test_sqlite_connections_are_configured(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'packbench.db'}")
    try:
        with engine.connect() as connection:
            pragma = lambda name: connection.execute(text(f"PRAGMA {name}")).scalar_one()  # noqa: E731
            assert pragma("journal_mode") == "wal"
            assert pragma("foreign_keys") == 1
            assert pragma("busy_timeout") == 30000
    finally:
        engine.dispose()


@pytest.mark.parametrize("url", ["sqlite:////tmp/a\x00b.db", 5, b"sqlite:///x.db"], ids=["nul", "int", "bytes"])
def test_a_url_that_is_no_text_or_holds_nul_is_one_line(url):
    """packbench.connect('sqlite:///a\\x00b.db') was the driver's ValueError ('embedded null byte')
    from deep inside SQLAlchemy; connect(5) a TypeError from its URL pattern."""
    message = error_of(lambda: Store(url))
    assert "a URL is text without control characters (NUL" in message and ENV_VAR in message


@pytest.mark.parametrize("end", ["\r", "\n", "\t"], ids=["cr", "lf", "tab"])
def test_a_url_ending_in_a_line_ending_creates_no_file_named_with_it(packbench_cli, tmp_path, end):
    """Bug caught: `PACKBENCH_DB_URL` read from a CRLF env file (`sqlite:///pb.db\r`) made
    `db upgrade` create and migrate a file named `pb.db\r`, exit 0; the next command, given the
    URL without it, found no database. A control character in the URL is refused in one line."""
    ran = packbench_cli("db", "upgrade", env={ENV_VAR: f"sqlite:///{tmp_path / 'pb.db'}{end}"}, cwd=tmp_path)
    assert ran.returncode == 2 and ran.stdout == "", ran
    assert ran.stderr.count("\n") == 1 and "without control characters" in ran.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_sqlite_file_name_longer_than_the_file_system_allows_is_one_line(tmp_path):
    """Was an OSError ('File name too long') from the read-only probe, through packbench.connect."""
    message = error_of(lambda: Store(f"sqlite:///{tmp_path / ('y' * 300 + '.db')}"))
    assert "File name too long" in message and "shorter path" in message and len(message) < 200


@pytest.mark.parametrize("fault", ["removed", "replaced"])
def test_a_sqlite_file_removed_or_replaced_while_open_refuses_writes(tmp_path, fault):
    """The open connection kept writing into the file the path no longer named: `rm pb.db` (or
    a copy moved over it) under a running `submit --wait` ended `done`, exit 0, with every row
    after it in a deleted file. Each transaction now checks the path still names the file the
    engine opened, and no new connection creates an empty file in its place."""
    path = tmp_path / "packbench.db"
    with Store(f"sqlite:///{path}") as store:
        store.upgrade()
        store.put_protocol(sha256="a" * 64, name="x", canonical_json="{}")
        path.rename(tmp_path / "away.db")
        if fault == "replaced":
            with Store(f"sqlite:///{path}") as other:
                other.upgrade()
        message = error_of(lambda: store.put_protocol(sha256="b" * 64, name="y", canonical_json="{}"))
        assert "removed or replaced" in message and ENV_VAR in message
        assert path.exists() == (fault == "replaced")  # nothing created where the file was
        if fault == "removed":  # put back (its WAL is still beside it): the same file, so writes go on
            (tmp_path / "away.db").replace(path)
            store.put_protocol(sha256="c" * 64, name="z", canonical_json="{}")


def test_a_server_that_never_answers_is_an_outage_after_the_urls_connect_timeout():
    """Bug caught: psycopg raises ConnectionTimeout (an OperationalError subclass) when
    connect_timeout expires; the class name was compared with "OperationalError", so an unreachable
    server was a generic "database error ... check the database", not `DatabaseUnavailable` (the
    outage `dispatch --follow` waits out), and the message gave 10 s whatever the URL set. A socket
    that accepts and never answers stands for the unreachable server."""
    import socket

    from packbench.db.errors import DatabaseUnavailable

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        port = silent.getsockname()[1]
        with pytest.raises(DatabaseUnavailable) as info:
            Store(f"postgresql+psycopg://postgres@127.0.0.1:{port}/test?connect_timeout=1").current()
    assert str(info.value) == (f"cannot connect to postgresql at 127.0.0.1:{port} (timed out after 1 s); check the "
                               f"host, port and firewall, or set {ENV_VAR}")
